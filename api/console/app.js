// The console's shell: login, hash routing (#/prefixes, #/register,
// #/prefix/<id>, #/traffic, #/playground) and the pages' lifecycle.
import { clearToken, getToken, onUnauthorized } from './api.js';
import { showLogin } from './login.js';
import { renderPrefixes } from './prefixes.js';
import { renderRegister } from './register.js';
import { renderDetail } from './detail.js';
import { renderTraffic } from './traffic.js';
import { renderPlayground } from './playground.js';

const PAGES = {
  prefixes: renderPrefixes,
  register: renderRegister,
  prefix: renderDetail,
  traffic: renderTraffic,
  playground: renderPlayground,
};

// What the current page left running (timers, streams): stopped on leaving it.
let stopCurrentPage = null;
// Bumped at each navigation, so that a slow page's late answers are dropped.
let generation = 0;

function parseHash() {
  const parts = location.hash.replace(/^#\/?/, '').split('/');
  const name = parts[0] || 'prefixes';
  return { name: PAGES[name] ? name : 'prefixes', arg: parts.slice(1).map(decodeURIComponent).join('/') };
}

function leavePage() {
  if (stopCurrentPage) stopCurrentPage();
  stopCurrentPage = null;
  generation += 1;
}

function highlightNav(name) {
  const section = name === 'prefix' ? 'prefixes' : name;
  for (const link of document.querySelectorAll('nav a[data-nav]')) {
    if (link.dataset.nav === section) link.setAttribute('aria-current', 'page');
    else link.removeAttribute('aria-current');
  }
}

async function route() {
  if (!getToken()) {
    logout();
    return;
  }
  leavePage();
  const mine = generation;
  const { name, arg } = parseHash();
  const main = document.getElementById('page');
  document.getElementById('login').hidden = true;
  document.getElementById('topbar').hidden = false;
  main.hidden = false;
  main.replaceChildren();
  main.dataset.page = name;
  delete main.dataset.ready;
  highlightNav(name);
  const page = {
    main,
    arg,
    alive: () => mine === generation,
    navigate: (hash) => {
      location.hash = hash;
    },
  };
  try {
    stopCurrentPage = (await PAGES[name](page)) || null;
    if (!page.alive() && stopCurrentPage) {
      stopCurrentPage();
      stopCurrentPage = null;
    }
  } catch (error) {
    console.error(error);
  }
}

// Back to the login form; message (optional) says why.
function logout(message) {
  leavePage();
  clearToken();
  const main = document.getElementById('page');
  main.hidden = true;
  main.replaceChildren();
  delete main.dataset.page;
  delete main.dataset.ready;
  document.getElementById('topbar').hidden = true;
  showLogin(message, () => {
    if (!location.hash || location.hash === '#' || location.hash === '#/') location.hash = '#/prefixes';
    else route();
  });
}

function start() {
  onUnauthorized(() => logout('The daemon refused the admin token (401). Log in again.'));
  document.getElementById('logout').addEventListener('click', () => logout());
  window.addEventListener('hashchange', route);
  route();
}

start();
