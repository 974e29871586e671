// api.ts: requestAPI's answers and errors, against a fake fetch passed in the server settings
// (no server): JSON back, or a GpuLeaseError with the server extension's code and message.
import { ServerConnection } from '@jupyterlab/services';
import { describe, expect, test, vi } from 'vitest';

import { GpuLeaseError, apiUrl, requestAPI } from '../src/api';

const BASE = 'http://localhost:8888/lab-user/';

/** Server settings whose fetch answers with `answer` (or throws it), and the fetch, to see what was asked. */
function settingsAnswering(answer: Response | Error) {
  const fetch = vi.fn(async () => {
    if (answer instanceof Error) {
      throw answer;
    }
    return answer;
  });
  const settings = ServerConnection.makeSettings({ baseUrl: BASE, wsUrl: 'ws://localhost:8888/lab-user/', fetch });
  return { settings, fetch };
}

async function errorOf(promise: Promise<unknown>): Promise<GpuLeaseError> {
  const error = await promise.then(
    () => null,
    e => e
  );
  expect(error).toBeInstanceOf(GpuLeaseError);
  return error as GpuLeaseError;
}

test('apiUrl: under the Jupyter server base URL', () => {
  const { settings } = settingsAnswering(new Response('{}'));
  expect(apiUrl(settings, 'bookings', 'r-1', 'end')).toBe(`${BASE}gpulease/bookings/r-1/end`);
});

test('JSON answers come back as they are, from the path asked', async () => {
  const { settings, fetch } = settingsAnswering(new Response('{"user": "alice", "leases": []}', { status: 200 }));
  expect(await requestAPI('leases?all=1', { method: 'GET' }, settings)).toEqual({ user: 'alice', leases: [] });
  expect(fetch).toHaveBeenCalledTimes(1);
  const asked = fetch.mock.calls[0] as unknown[];
  const url = asked[0] instanceof Request ? asked[0].url : String(asked[0]);
  // (JupyterLab adds a cache buster to a GET's query)
  expect(url.startsWith(`${BASE}gpulease/leases?all=1`)).toBe(true);
});

describe('errors', () => {
  test("the server extension's JSON error: its status, code, message and details", async () => {
    const details = { clashes: [], capacity: 4, reserved: 4, max_gpus: 0, suggestions: [] };
    const body = JSON.stringify({ code: 'reservation_clash', message: 'over-booked', details });
    const { settings } = settingsAnswering(new Response(body, { status: 409, statusText: 'Conflict' }));
    const error = await errorOf(requestAPI('bookings', { method: 'POST', body: '{}' }, settings));
    expect([error.status, error.code, error.message]).toEqual([409, 'reservation_clash', 'over-booked']);
    expect(error.details).toEqual(details);
  });

  test('an answer that is not JSON (a proxy\'s page): the HTTP status in words', async () => {
    const { settings } = settingsAnswering(new Response('<html>bad gateway</html>', { status: 502, statusText: 'Bad Gateway' }));
    const error = await errorOf(requestAPI('cluster', {}, settings));
    expect([error.status, error.code, error.details]).toEqual([502, 'http_error', null]);
    expect(error.message).toBe(`HTTP 502 Bad Gateway from ${BASE}gpulease/cluster`);
  });

  test('a 2xx answer without JSON is a bad answer (an old or missing server extension)', async () => {
    const { settings } = settingsAnswering(new Response('', { status: 200 }));
    const error = await errorOf(requestAPI('version', {}, settings));
    expect([error.status, error.code]).toEqual([200, 'bad_answer']);
    expect(error.message).toBe(`${BASE}gpulease/version did not answer with JSON`);
  });

  test('no answer at all: status 0, a network error', async () => {
    const { settings } = settingsAnswering(new TypeError('fetch failed'));
    const error = await errorOf(requestAPI('cluster', {}, settings));
    expect([error.status, error.code]).toEqual([0, 'network']);
    expect(error.message).toMatch(/^cannot reach the Jupyter server: .*fetch failed/);
  });
});
