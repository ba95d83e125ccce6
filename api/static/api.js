// The page's access to the API: the bearer token (kept in localStorage), authenticated requests,
// the connection line, and the job states (``GET /v1/job-states``: which ones are terminal).

import { $ } from "./format.js";

const TOKEN_KEY = "hpservice.token";
export const TERMINAL = new Set(); // filled from GET /v1/job-states before anything is shown

function loadToken() {
  try {
    return localStorage.getItem(TOKEN_KEY) || "";
  } catch {
    return "";
  }
}

export let token = loadToken();
export let authNeeded = false;

export function saveToken(value) {
  token = value;
  try {
    if (value) localStorage.setItem(TOKEN_KEY, value);
    else localStorage.removeItem(TOKEN_KEY);
  } catch {
    // storage unavailable (private mode): the token lives for this page only
  }
  $("forget-token").hidden = !token;
}

export class AuthError extends Error {}

export function showAuth(message) {
  authNeeded = true;
  const box = $("auth");
  $("auth-msg").textContent = message;
  if (box.hidden) {
    box.hidden = false;
    $("token-input").focus();
  }
}

export function hideAuth() {
  authNeeded = false;
  $("auth").hidden = true;
}

export async function apiSend(method, path) {
  const headers = { Accept: "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  const res = await fetch(path, { method, headers, cache: "no-store" });
  if (res.status === 401) {
    showAuth(token ? "The saved token was rejected. Enter another one." : "This server needs an API token.");
    throw new AuthError("unauthorized");
  }
  if (!res.ok) {
    let message = `${res.status} ${res.statusText}`;
    try {
      const body = await res.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch {
      // not JSON
    }
    const err = new Error(message);
    err.status = res.status;
    throw err;
  }
  return res.status === 204 ? null : res.json();
}

export async function api(path) {
  return apiSend("GET", path);
}

export function setConn(text, bad = false) {
  const node = $("conn");
  node.textContent = text;
  node.classList.toggle("conn-bad", bad);
}

export const METRIC_REGISTRY = []; // filled from GET /v1/metric-registry: every metric a step reports

export async function loadMetricRegistry() {
  const res = await fetch("/v1/metric-registry", { headers: { Accept: "application/json" }, cache: "no-store" });
  if (!res.ok) throw new Error(`${res.status} ${res.statusText}`);
  METRIC_REGISTRY.push(...((await res.json()).metrics || []));
}

export async function loadJobStates() {
  const res = await fetch("/v1/job-states", { headers: { Accept: "application/json" }, cache: "no-store" });
  if (!res.ok) throw new Error(`${res.status} ${res.statusText}`);
  for (const s of (await res.json()).terminal || []) TERMINAL.add(s);
}
