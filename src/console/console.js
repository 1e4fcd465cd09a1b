// The waltail console: polls the JSON API once a second and renders it.
// Every value is written with textContent, never as markup, so a table name
// or an error message cannot inject anything into the page.
'use strict';

const POLL_MS = 1000;
const $ = (id) => document.getElementById(id);

function human(bytes) {
  const units = ['B', 'kB', 'MB', 'GB', 'TB'];
  let n = Number(bytes) || 0;
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return (i === 0 ? String(n) : n.toFixed(1)) + ' ' + units[i];
}

function count(n) {
  return n === null || n === undefined ? '-' : Number(n).toLocaleString('en-US');
}

function text(id, value) {
  const el = $(id);
  const s = value === null || value === undefined ? '-' : String(value);
  if (el.textContent !== s) el.textContent = s;
}

function row(cells) {
  const tr = document.createElement('tr');
  for (const [value, cls] of cells) {
    const td = document.createElement('td');
    td.textContent = value === null || value === undefined ? '-' : String(value);
    if (cls) td.className = cls;
    tr.appendChild(td);
  }
  return tr;
}

function emptyRow(columns, message) {
  const tr = document.createElement('tr');
  tr.className = 'empty';
  const td = document.createElement('td');
  td.colSpan = columns;
  td.textContent = message;
  tr.appendChild(td);
  return tr;
}

const FATE_CLASS = { delivered: 'ok', parked: 'bad', held: 'warn', captured: 'muted' };

function renderEvents(tbodyId, events, emptyMessage) {
  const tbody = $(tbodyId);
  const rows = events.map((e) => {
    const tr = row([
      [e.seq, 'num'], [e.op], [e.table], [e.commit_lsn, 'mono'],
      [e.status, FATE_CLASS[e.status] || ''], [e.key, 'mono'],
    ]);
    tr.dataset.seq = e.seq;
    tr.className = 'event ' + e.status.replace(/ /g, '-');
    return tr;
  });
  tbody.replaceChildren(...(rows.length ? rows : [emptyRow(6, emptyMessage)]));
}

function renderState(s) {
  text('pipeline', s.pipeline);
  text('destination', '\u2192 ' + s.destination + ' \u00b7 slot ' + s.slot);
  const ready = $('ready');
  ready.textContent = s.ready ? 'streaming' : 'not streaming';
  ready.className = 'badge ' + (s.ready ? 'ok' : 'warn');
  text('confirmed_lsn', s.confirmed_lsn);
  text('next_seq', count(s.next_seq));
  text('changes_received', count(s.changes_received));
  text('changes_archived', count(s.changes_archived));
  text('objects_written', count(s.objects_written));
  text('bytes_written', human(s.bytes_written));
  text('put_retries', count(s.put_retries));
  let lag = human(s.slot_lag_bytes);
  if (s.slot_lag_warning) {
    lag += ' \u2014 over the ' + human(s.slot_lag_warn_bytes) + ' warning threshold';
  }
  text('slot_lag', lag);
  $('slot_lag').className = s.slot_lag_warning ? 'bad' : '';
  text('last_key', s.events.last_key || 'none yet');
  const parked = s.parked + ' parked, ' + s.held + ' held';
  text('parked_summary', s.parked + s.held > 0 ? parked : '');
  renderBackfills(s.backfills || []);
  renderEvents('first', s.events.first, 'no changes captured yet');
  renderEvents('recent', s.events.recent, 'none beyond the first changes');
  const beyond = s.events.captured - s.events.first.length;
  text('recent_summary', beyond > 0 ? 'of ' + count(s.events.captured) + ' captured' : '');
}

const BACKFILL_CLASS = { done: 'ok', running: 'warn', pending: 'muted', failed: 'bad', cancelled: 'muted' };

// Backfills in progress and the last few finished: shown only when there are any.
function renderBackfills(backfills) {
  $('backfills_section').hidden = backfills.length === 0;
  const rows = backfills.map((b) => {
    const share = b.estimate > 0 ? Math.min(100, Math.floor((100 * b.rows_read) / b.estimate)) + '%' : '-';
    return row([
      [b.table], [b.status, BACKFILL_CLASS[b.status] || ''], [count(b.rows_read), 'num'],
      [count(b.estimate), 'num'], [share, 'num'], [count(b.rows_sent), 'num'],
      [b.requested_at, 'mono'], [b.error, b.error ? 'bad' : ''],
    ]);
  });
  $('backfills').replaceChildren(...rows);
}

// Parked rows are updated in place (keyed by id) rather than rebuilt, so a
// click on a Replay button is never lost to a refresh.
function renderParked(p) {
  const tbody = $('parked');
  const wanted = new Set(p.batches.map((b) => String(b.id)));
  for (const tr of [...tbody.children]) {
    if (!wanted.has(tr.dataset.id)) tr.remove();
  }
  for (const b of p.batches) {
    let tr = tbody.querySelector('tr[data-id="' + b.id + '"]');
    if (!tr) {
      tr = row(Array(8).fill(['']));
      tr.dataset.id = b.id;
      tr.className = 'batch';
      const td = document.createElement('td');
      const button = document.createElement('button');
      button.className = 'replay';
      button.textContent = 'Replay';
      button.addEventListener('click', () => replay(b.id, button));
      td.appendChild(button);
      tr.appendChild(td);
      tbody.appendChild(tr);
    }
    const cells = tr.children;
    const status = b.status === 'replay' ? 'replay requested' : b.status;
    const values = [b.id, b.first_seq + '-' + b.last_seq, status, b.attempts, b.tables,
      b.key, b.last_error || '-', b.parked_at];
    const classes = ['num', 'mono', b.status === 'parked' ? 'bad' : 'warn', 'num', '', 'mono',
      'error', 'mono'];
    values.forEach((v, i) => {
      if (cells[i].textContent !== String(v)) cells[i].textContent = String(v);
      cells[i].className = classes[i];
    });
    tr.classList.toggle('parked', b.status === 'parked');
    const button = cells[8].firstChild;
    button.hidden = b.status === 'held';
    if (b.status === 'parked' && !button.dataset.pending) {
      button.disabled = false;
      button.textContent = 'Replay';
    } else if (b.status === 'replay') {
      button.disabled = true;
      button.textContent = 'Replaying\u2026';
    }
  }
  const placeholder = tbody.querySelector('tr.empty');
  if (p.batches.length === 0 && !placeholder) {
    tbody.appendChild(emptyRow(9, 'no parked batches'));
  } else if (p.batches.length > 0 && placeholder) {
    placeholder.remove();
  }
  if (p.total > p.batches.length) {
    text('message', 'showing ' + p.batches.length + ' of ' + p.total +
      ' parked and held batches; `waltail parked list` shows them all');
  }
}

function message(s, bad) {
  text('message', s);
  $('message').className = bad ? 'bad' : 'ok';
}

async function replay(id, button) {
  button.disabled = true;
  button.dataset.pending = '1';
  button.textContent = 'Requested\u2026';
  try {
    // The custom header is what the server checks to know the request comes
    // from this page (another site's page cannot send it without a CORS
    // preflight, which the server never grants).
    const r = await fetch('/api/parked/' + encodeURIComponent(id) + '/replay', {
      method: 'POST',
      headers: { 'X-Waltail': '1' },
    });
    const body = await r.json().catch(() => ({}));
    if (r.ok) {
      message('Replay of batch ' + id + ' requested: the pipeline delivers it within a second.', false);
    } else {
      message('Replay of batch ' + id + ' refused: ' + (body.error || 'HTTP ' + r.status), true);
    }
  } catch (e) {
    message('Replay of batch ' + id + ' failed: ' + e, true);
  } finally {
    delete button.dataset.pending;
  }
  poll();
}

async function getJSON(path) {
  const r = await fetch(path, { cache: 'no-store' });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(path + ': ' + (body.error || 'HTTP ' + r.status));
  return body;
}

let polling = false;
async function poll() {
  if (polling) return;
  polling = true;
  try {
    const [state, parked] = await Promise.all([getJSON('/api/state'), getJSON('/api/parked')]);
    renderState(state);
    renderParked(parked);
    text('conn', '');
  } catch (e) {
    text('conn', 'waltail is not answering (' + e.message + ')');
    const ready = $('ready');
    ready.textContent = 'unknown';
    ready.className = 'badge muted';
  } finally {
    polling = false;
  }
}

poll();
setInterval(poll, POLL_MS);
