// Drag-to-rank with a <select> fallback, and JSON submission of a judgement.
// Without this script the page still works: the selects give the ranks and the form posts.
// No rank is chosen when the page opens: a ranking left untouched is not sent (the shown order
// is random, not a judgement); the first drag or rank choice fills every rank.
(function () {
  "use strict";
  var form = document.getElementById("judgement");
  if (!form || form.dataset.done) { return; }

  function syncSelects(list) {
    Array.prototype.forEach.call(list.children, function (li, i) {
      li.querySelector("select").value = String(i + 1);
    });
  }

  Array.prototype.forEach.call(document.querySelectorAll("ol.ranking"), function (list) {
    var dragged = null;
    list.addEventListener("dragstart", function (e) {
      dragged = e.target.closest("li");
      if (!dragged) { return; }
      dragged.classList.add("dragging");
      e.dataTransfer.effectAllowed = "move";
      e.dataTransfer.setData("text/plain", dragged.dataset.letter);
    });
    list.addEventListener("dragover", function (e) {
      if (!dragged) { return; }
      e.preventDefault();
      var over = e.target.closest("li");
      if (!over || over === dragged || over.parentNode !== list) { return; }
      var box = over.getBoundingClientRect();
      var after = (e.clientY - box.top) > box.height / 2;
      list.insertBefore(dragged, after ? over.nextSibling : over);
    });
    list.addEventListener("drop", function (e) { e.preventDefault(); });
    list.addEventListener("dragend", function () {
      if (dragged) { dragged.classList.remove("dragging"); }
      dragged = null;
      syncSelects(list);
    });
    list.addEventListener("change", function (e) {
      var select = e.target;
      if (select.tagName !== "SELECT") { return; }
      var li = select.closest("li");
      var target = parseInt(select.value, 10) - 1;
      list.removeChild(li);
      list.insertBefore(li, list.children[target] || null);
      syncSelects(list);
    });
  });

  form.addEventListener("submit", function (e) {
    e.preventDefault();
    var status = document.getElementById("status");
    var payload = {};
    var missing = [];
    ["understanding", "generation"].forEach(function (section) {
      var ratings = {};
      var list = form.querySelector('ol.ranking[data-section="' + section + '"]');
      var ranking = Array.prototype.map.call(list.children, function (li) { return li.dataset.letter; });
      ranking.slice().sort().forEach(function (letter) {
        var checked = form.querySelector('input[name="' + section + ".rating." + letter + '"]:checked');
        if (checked) { ratings[letter] = checked.value; } else { missing.push(section + " " + letter); }
      });
      payload[section] = { ratings: ratings, ranking: ranking };
    });
    if (missing.length) {
      status.textContent = "Rate every output first: " + missing.join(", ");
      status.className = "error";
      return;
    }
    var unranked = ["understanding", "generation"].filter(function (section) {
      var selects = form.querySelectorAll('ol.ranking[data-section="' + section + '"] select');
      return Array.prototype.some.call(selects, function (s) { return !s.value; });
    });
    if (unranked.length) {
      status.textContent = "Rank the outputs first (drag them or pick their ranks): " + unranked.join(", ");
      status.className = "error";
      return;
    }
    var button = document.getElementById("submit");
    button.disabled = true;
    status.textContent = "Saving...";
    status.className = "";
    fetch(form.getAttribute("action"), {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(payload),
      credentials: "same-origin"
    }).then(function (r) {
      return r.json().then(function (body) { return { code: r.status, body: body }; });
    }).then(function (res) {
      if (res.code === 200 || res.code === 201) {
        window.location.href = res.body.next;
      } else {
        status.textContent = res.body.error || ("Error " + res.code);
        status.className = "error";
        button.disabled = false;
      }
    }).catch(function (err) {
      status.textContent = "Not saved (" + err + "); try again.";
      status.className = "error";
      button.disabled = false;
    });
  });
})();
