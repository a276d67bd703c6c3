// The login form: the token is checked with GET /admin/v1/prefixes before
// it is kept (sessionStorage, this tab only).
import { api, setToken } from './api.js';

let onSuccess = () => {};

function showError(text) {
  const error = document.getElementById('login-error');
  error.textContent = text || '';
  error.hidden = !text;
}

async function submit(event) {
  event.preventDefault();
  const input = document.getElementById('login-token');
  const button = document.getElementById('login-submit');
  const token = input.value.trim();
  if (!token) {
    showError('Enter the admin token.');
    return;
  }
  button.disabled = true;
  showError('');
  try {
    await api.listPrefixes({ token });
    setToken(token);
    input.value = '';
    onSuccess();
  } catch (error) {
    showError(error.status === 401 ? 'Wrong admin token: the daemon answered 401.' : `Cannot check the token: ${error.message}`);
  } finally {
    button.disabled = false;
  }
}

let wired = false;

export function showLogin(message, then) {
  onSuccess = then;
  if (!wired) {
    document.getElementById('login-form').addEventListener('submit', submit);
    wired = true;
  }
  document.getElementById('login').hidden = false;
  showError(message);
  document.getElementById('login-token').focus();
}
