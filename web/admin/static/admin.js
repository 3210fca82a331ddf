// Re-fetch elements marked data-refresh every data-every seconds (no libraries).
// The response is either the fragment itself, or a whole page from which the
// element matching data-select is taken. Pauses while the tab is hidden.
(function () {
  "use strict";
  function refresh(el) {
    if (document.hidden) { return; }
    fetch(el.dataset.refresh, { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } })
      .then(function (r) {
        if (r.redirected || !r.ok) { throw new Error("status " + r.status); }
        return r.text();
      })
      .then(function (html) {
        if (el.dataset.select) {
          var doc = new DOMParser().parseFromString(html, "text/html");
          var part = doc.querySelector(el.dataset.select);
          if (part) { el.innerHTML = part.innerHTML; }
        } else {
          el.innerHTML = html;
        }
        el.dataset.refreshedAt = String(Date.now());
      })
      .catch(function () { /* keep the last good content; try again next tick */ });
  }
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-refresh]").forEach(function (el) {
      var every = parseFloat(el.dataset.every || "5") * 1000;
      setInterval(function () { refresh(el); }, every);
    });
  });
})();
