// The inspect pages' common script, included first inside each view's closure: the page's
// data (#mh-data) and the DOM helpers; text only ever goes in through textContent.
const D = JSON.parse(document.getElementById("mh-data").textContent);
const $ = (id) => document.getElementById(id);

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// The bytes of a base64 string (how the pages store their arrays).
function bytes(b64) {
  if (!b64) return new Uint8Array(0);
  const s = atob(b64), out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
  return out;
}
