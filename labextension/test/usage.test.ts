// usage.tsx: the Usage tab's figures as written (GPU-time in a unit, waits, percentages), its
// CSV, the windows of its ranges and the query it sends.
import { describe, expect, test } from 'vitest';

import { IUsageFigures, IUsageSummary } from '../src/api';
import {
  IQuery,
  cellsText,
  gpuTime,
  gpuUnit,
  parts,
  rangeWindow,
  splitNote,
  summaryQuery,
  toCsv,
  totalsLine,
  utcDay,
  waitText
} from '../src/usage';

describe('toCsv', () => {
  test('a header, rows, a line each, and a last line break', () => {
    expect(toCsv(['user', 'calls'], [['alice', 3], ['bob', 0]])).toBe('user,calls\nalice,3\nbob,0\n');
  });

  test('quoted where a field holds a comma, a quote or a line break; null and undefined empty', () => {
    expect(toCsv(['key', 'v'], [['team:a,b', null], ['say "hi"', undefined], ['two\nlines', 1.5]])).toBe(
      'key,v\n"team:a,b",\n"say ""hi""",\n"two\nlines",1.5\n'
    );
  });
});

describe('GPU-time', () => {
  test('the unit: hours, unless all is under an hour (minutes) or a minute (seconds)', () => {
    expect(gpuUnit(3600).name).toBe('GPU-hours');
    expect(gpuUnit(3599).name).toBe('GPU-minutes');
    expect(gpuUnit(60).seconds).toBe(60);
    expect(gpuUnit(59)).toEqual({ name: 'GPU-seconds', seconds: 1 });
  });

  test('2 decimals under 10, 1 under 100, whole above', () => {
    const hours = gpuUnit(7200);
    expect(gpuTime(5400, hours)).toBe('1.50');
    expect(gpuTime(36_000 + 1800, hours)).toBe('10.5');
    expect(gpuTime(360_000, hours)).toBe('100');
    expect(gpuTime(0, hours)).toBe('0.00');
  });
});

test('waitText: none, ms, s, min, h', () => {
  expect(waitText(null)).toBe('-');
  expect(waitText(250)).toBe('250 ms');
  expect(waitText(2500)).toBe('2.5 s');
  expect(waitText(45_000)).toBe('45 s');
  expect(waitText(600_000)).toBe('10 min');
  expect(waitText(7_200_000)).toBe('2.0 h');
});

test('parts: held time split into used, idle, not measured; warm apart; never negative', () => {
  const f = { used_gpu_s: 30, sampled_gpu_s: 80, held_gpu_s: 100, warm_gpu_s: 7 } as IUsageFigures;
  expect(parts(f)).toEqual({ used: 30, idle: 50, unmeasured: 20, warm: 7 });
  const odd = { used_gpu_s: 90, sampled_gpu_s: 80, held_gpu_s: 70, warm_gpu_s: 0 } as IUsageFigures;
  expect(parts(odd)).toEqual({ used: 90, idle: 0, unmeasured: 0, warm: 0 });
});

describe('rangeWindow', () => {
  const now = Date.parse('2026-11-27T15:30:00Z');
  const day = (d: string) => Date.parse(`${d}T00:00:00Z`) / 1000;

  test('today and the last 7 or 30 UTC days, up to now', () => {
    expect(rangeWindow('today', now, '', '')).toEqual({ from: day('2026-11-27'), to: null });
    expect(rangeWindow('7d', now, '', '')).toEqual({ from: day('2026-11-21'), to: null });
    expect(rangeWindow('30d', now, '', '')).toEqual({ from: day('2026-10-29'), to: null });
  });

  test('custom: whole UTC days, both included', () => {
    expect(rangeWindow('custom', now, '2026-11-01', '2026-11-03')).toEqual({
      from: day('2026-11-01'),
      to: day('2026-11-04')
    });
  });

  test('custom: an error in words for a range that cannot be asked for', () => {
    expect(rangeWindow('custom', now, '', '2026-11-03')).toEqual({
      error: 'Pick the first and the last day of the range.'
    });
    expect(rangeWindow('custom', now, '2026-11-05', '2026-11-03')).toEqual({
      error: 'The last day (2026-11-03) is before the first (2026-11-05): pick a last day on or after it.'
    });
  });

  test('utcDay', () => {
    expect(utcDay(Date.parse('2026-11-27T23:59:59Z'))).toBe('2026-11-27');
  });
});

describe('summaryQuery', () => {
  const q = (more: Partial<IQuery> = {}): IQuery => ({
    range: '7d',
    first: '',
    last: '',
    by: 'user',
    pool: '',
    user: null,
    ...more
  });

  test('grouped as asked, with the rows by pool too, up to now', () => {
    expect(Object.fromEntries(new URLSearchParams(summaryQuery(q({ by: 'team' }), { from: 100, to: null })))).toEqual({
      from: '100',
      by: 'team',
      also_by: 'pool'
    });
  });

  test('by pool needs no second grouping', () => {
    expect(new URLSearchParams(summaryQuery(q({ by: 'pool' }), { from: 100, to: 200 })).has('also_by')).toBe(false);
  });

  test("one user's usage is grouped by user, whatever the grouping picked; a pool narrows it", () => {
    const args = new URLSearchParams(summaryQuery(q({ by: 'team', user: 'bob', pool: 'A100' }), { from: 1, to: 2 }));
    expect(Object.fromEntries(args)).toEqual({ from: '1', to: '2', by: 'user', user: 'bob', pool: 'A100', also_by: 'pool' });
  });
});

describe('cells, in one word', () => {
  const figures = (more: Partial<IUsageFigures>): IUsageFigures =>
    ({
      calls: 6,
      cells: 8,
      warm_cells: 2,
      held_gpu_s: 120,
      sampled_gpu_s: 120,
      used_gpu_s: 0,
      util_pct: 0,
      warm_gpu_s: 900,
      wait_p50_ms: 20,
      wait_p95_ms: 1500,
      ...more
    }) as IUsageFigures;
  const summary = (f: IUsageFigures): IUsageSummary =>
    ({ days: ['2026-11-27'], total: f, daily: [], groups: [] }) as unknown as IUsageSummary;

  test('the headline counts cells, those that started warm among them; never calls', () => {
    expect(cellsText(figures({}))).toBe('8 cells (2 started warm)');
    expect(cellsText(figures({ calls: 1, cells: 1, warm_cells: 0 }))).toBe('1 cell');
    const line = totalsLine(summary(figures({})), gpuUnit(900));
    expect(line).toBe(
      '2026-11-27 (UTC): 8 cells (2 started warm), 2.00 GPU-minutes held (0% of sampled time used), ' +
        '15.0 warm; wait p50 20 ms, p95 1.5 s'
    );
    expect(line).not.toMatch(/\bcalls?\b/);
  });

  test('under the chart: why used is 0 % on simulated GPUs, and what warm time is', () => {
    const note = splitNote(summary(figures({})), 'A100-80GB');
    expect(note).toContain('The GPUs of A100-80GB are simulated: nothing runs on them');
    expect(note).toContain('gpulease simulate util');
    expect(note).toContain("a warm worker keeps a notebook's model on its GPU between cells");
    expect(note).toContain('(so it can be more than the time held)'); // 900 s warm, 120 s held
    expect(note).toContain('not charged as use');
    const real = splitNote(summary(figures({ warm_gpu_s: 60 })), '');
    expect(real).not.toContain('simulated');
    expect(real).not.toContain('more than the time held');
    expect(splitNote(summary(figures({ warm_gpu_s: 0 })), '')).toBe('');
  });
});
