// The sign-in form: the API checks the key and keeps it in an HttpOnly session cookie; then the
// page the user asked for loads again, signed in.
"use strict";

document.getElementById("signin-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const input = document.getElementById("api-key");
  const error = document.getElementById("signin-error");
  error.hidden = true;
  try {
    await MF.api("/v1/session", { method: "POST", body: { api_key: input.value.trim() } });
    location.reload();
  } catch (e) {
    error.textContent = e.status === 401 ? "This key is unknown or revoked." : e.message;
    error.hidden = false;
    input.select();
  }
});
