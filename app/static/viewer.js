// The run viewer's live updates: every section marked data-refresh="<seconds>" is fetched
// again from the server after that many seconds and replaced when it changed. The server
// drops the mark once the run is closed, which ends the polling. No inline script: the
// pages' Content-Security-Policy allows only this file.
"use strict";
(function () {
  function schedule(section) {
    const seconds = Number(section.dataset.refresh);
    if (!seconds || !section.id) {
      return;
    }
    setTimeout(function () { refresh(section); }, seconds * 1000);
  }

  async function refresh(section) {
    let fresh = null;
    try {
      const reply = await fetch(location.href, { credentials: "same-origin", headers: { Accept: "text/html" } });
      if (reply.status === 401 || reply.status === 404) {
        return;  // signed out, or the run's record expired: nothing more to show
      }
      if (!reply.ok) {
        return schedule(section);
      }
      const page = new DOMParser().parseFromString(await reply.text(), "text/html");
      fresh = page.getElementById(section.id);
    } catch (err) {
      return schedule(section);  // the facade restarting: try again later
    }
    if (!fresh) {
      return;
    }
    if (fresh.outerHTML === section.outerHTML) {
      return schedule(section);  // unchanged: keep the reader's scroll positions
    }
    const node = document.importNode(fresh, true);
    section.replaceWith(node);
    schedule(node);
  }

  document.querySelectorAll("[data-refresh]").forEach(schedule);
})();
