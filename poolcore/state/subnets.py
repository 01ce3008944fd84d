"""The blocks of a host's run-network range (poolcore/subnets.py) its runs hold:

  host:<h>:subnets         hash: block index -> owner (a run id, or RESERVED)
  host:<h>:subnet-owners   hash: owner -> its indices, comma-separated

Taking and giving back are one script each, so two starts never get the same block and a
crash leaves either the whole allocation or none. An owner asking again gets what it holds
(a retried start), topped up to what it needs. RESERVED marks blocks the host's worker found
in use outside termpool at its start (a route, a network Docker made itself).
"""

from __future__ import annotations

import functools

import redis

from poolcore.state import keys

RESERVED = "reserved"

# KEYS: index hash, owners hash. ARGV: owner, blocks wanted, blocks in the range.
# The owner's indices (held and new), or false when the range has too few free blocks.
_TAKE = """
local held = redis.call('HGET', KEYS[2], ARGV[1])
local taken = {}
if held then for i in string.gmatch(held, '%d+') do taken[#taken + 1] = tonumber(i) end end
local want, total = tonumber(ARGV[2]), tonumber(ARGV[3])
local new = {}
local i = 0
while #taken + #new < want and i < total do
  if redis.call('HEXISTS', KEYS[1], i) == 0 then new[#new + 1] = i end
  i = i + 1
end
if #taken + #new < want then return false end
for _, n in ipairs(new) do
  redis.call('HSET', KEYS[1], n, ARGV[1])
  taken[#taken + 1] = n
end
if #taken > 0 then redis.call('HSET', KEYS[2], ARGV[1], table.concat(taken, ',')) end
return taken
"""
# KEYS: index hash, owners hash. ARGV: owner. The number of blocks given back.
_GIVE_BACK = """
local held = redis.call('HGET', KEYS[2], ARGV[1])
if not held then return 0 end
local n = 0
for i in string.gmatch(held, '%d+') do
  if redis.call('HGET', KEYS[1], i) == ARGV[1] then
    redis.call('HDEL', KEYS[1], i)
    n = n + 1
  end
end
redis.call('HDEL', KEYS[2], ARGV[1])
return n
"""
# KEYS: index hash, owners hash. ARGV: the indices to reserve (free ones only; the old
# reservation is given back first). The indices reserved.
_RESERVE = """
local old = redis.call('HGET', KEYS[2], 'reserved')
if old then
  for i in string.gmatch(old, '%d+') do
    if redis.call('HGET', KEYS[1], i) == 'reserved' then redis.call('HDEL', KEYS[1], i) end
  end
  redis.call('HDEL', KEYS[2], 'reserved')
end
local taken = {}
for _, i in ipairs(ARGV) do
  if redis.call('HSETNX', KEYS[1], i, 'reserved') == 1 then taken[#taken + 1] = i end
end
if #taken > 0 then redis.call('HSET', KEYS[2], 'reserved', table.concat(taken, ',')) end
return taken
"""


class SubnetsState:
    """Store's run-network blocks."""

    _r: redis.Redis  # Store.__init__ sets it

    @functools.cached_property
    def _take_blocks(self):
        return self._r.register_script(_TAKE)

    @functools.cached_property
    def _give_back(self):
        return self._r.register_script(_GIVE_BACK)

    @functools.cached_property
    def _reserve(self):
        return self._r.register_script(_RESERVE)

    def _keys(self, host: str) -> list[str]:
        return [keys.subnets_key(host), keys.subnet_owners_key(host)]

    def take_subnets(self, host: str, owner: str, count: int, total: int) -> list[int] | None:
        """`count` blocks of the host's `total` for `owner` (the ones it holds first); None when
        too few are free."""
        taken = self._take_blocks(keys=self._keys(host), args=[owner, count, total])
        return None if taken is None else [int(i) for i in taken]

    def give_back_subnets(self, host: str, owner: str) -> int:
        """Free the owner's blocks (none held: 0). Safe to call twice."""
        return int(self._give_back(keys=self._keys(host), args=[owner]))

    def reserve_subnets(self, host: str, indices: set[int]) -> list[int]:
        """Mark these blocks as used outside termpool (those no run holds), replacing the last
        reservation; the indices now reserved."""
        return [int(i) for i in self._reserve(keys=self._keys(host), args=sorted(indices))]

    def subnet_owners(self, host: str) -> dict[str, list[int]]:
        """Every owner of blocks on the host (RESERVED included) and its indices."""
        held = self._r.hgetall(keys.subnet_owners_key(host))
        return {owner: [int(i) for i in text.split(",") if i] for owner, text in held.items()}

    def subnets_in_use(self, host: str) -> tuple[int, int]:
        """(blocks held by runs, blocks reserved) on the host."""
        pipe = self._r.pipeline(transaction=False)
        pipe.hlen(keys.subnets_key(host))
        pipe.hget(keys.subnet_owners_key(host), RESERVED)
        held, reserved = pipe.execute()
        reserved = len([i for i in (reserved or "").split(",") if i])
        return int(held) - reserved, reserved
