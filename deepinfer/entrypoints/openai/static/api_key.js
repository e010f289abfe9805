// The API key field of the chat page and the dashboard: kept in localStorage under one name, so a key
// entered on one page serves the other, and sent as `Authorization: Bearer KEY`.
"use strict";

const KEY_STORAGE = "deepinfer.apiKey";

function keyField() {
  return document.getElementById("api-key");
}

function loadStoredKey() {
  try {
    keyField().value = localStorage.getItem(KEY_STORAGE) || "";
  } catch {
    // storage may be disabled (private mode, a file:// page); the field still works for this visit
  }
}

function storeKey() {
  try {
    const key = keyField().value.trim();
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
  } catch {
    // see loadStoredKey
  }
}

function authHeaders() {
  const key = keyField().value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}
