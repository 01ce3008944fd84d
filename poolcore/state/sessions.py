"""Shell sessions of a run: sess:<run> and sess:<run>:<sid>."""

from __future__ import annotations

import redis

from poolcore.state import keys


class SessionsState:
    """Store's shell sessions."""

    _r: redis.Redis  # Store.__init__ sets it

    def session(self, run_id: str, sid: str) -> dict:
        return self._r.hgetall(keys.session_key(run_id, sid))

    def update_session(self, run_id: str, sid: str, **fields) -> None:
        key = keys.session_key(run_id, sid)
        self._r.hset(key, mapping={k: str(v) for k, v in fields.items()})
        self._r.sadd(keys.sessions_key(run_id), sid)

    def session_ids(self, run_id: str) -> list[str]:
        return sorted(self._r.smembers(keys.sessions_key(run_id)))

    def copy_sessions(self, source: str, target: str, restarted: set) -> None:
        """A fork's child gets the source's sessions; a restarted one reads its new output from 0."""
        for sid in self.session_ids(source):
            record = self.session(source, sid)
            if sid in restarted:
                record.update(offset="0", done="0")
            if record:
                self.update_session(target, sid, **record)

    def drop_sessions(self, run_id: str) -> None:
        sids = self._r.smembers(keys.sessions_key(run_id))
        if sids:
            self._r.delete(*[keys.session_key(run_id, sid) for sid in sids])
        self._r.delete(keys.sessions_key(run_id))
