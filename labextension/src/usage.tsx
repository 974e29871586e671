/**
 * The Usage tab: who held the GPUs, how much of that they used, and who waited, from the lease
 * server's hourly rollups (GET /gpulease/usage/summary, docs/usage.md). Charts are Observable Plot
 * (SVG drawn in currentColor, so JupyterLab's light and dark themes colour its axes and text); under
 * each chart a table of the same figures for keyboard and screen-reader users, with a CSV download
 * of the server's figures as they are (GPU-seconds, milliseconds).
 *
 * Days are UTC days, as the summary counts them: a lease's GPU time is spread over the hours it was
 * held, and shows once the lease has ended.
 */
import * as Plot from '@observablehq/plot';
import React, { useCallback, useEffect, useRef, useState } from 'react';

import { IUsageDay, IUsageFigures, IUsageSummary } from './api';
import { GpuLeaseModel, describe } from './model';

export type Range = 'today' | '7d' | '30d' | 'custom';
export type By = 'user' | 'team' | 'pool';

const RANGES: { id: Range; label: string }[] = [
  { id: 'today', label: 'Today' },
  { id: '7d', label: '7 days' },
  { id: '30d', label: '30 days' },
  { id: 'custom', label: 'Custom' }
];
const DAY_MS = 86_400_000;
/** At most this many groups are drawn apart in a stacked chart; the rest are summed as "others". */
const MOST_GROUPS = 9;
const OTHERS = 'others';
/** Where the split of held GPU-time is drawn, in this order (bottom up), and its colours. */
const PARTS = [
  { key: 'used', label: 'used', color: '#3a923a' },
  { key: 'idle', label: 'held idle', color: '#e8871e' },
  { key: 'unmeasured', label: 'not measured', color: '#8c8c8c' },
  { key: 'warm', label: 'warm (lendable)', color: '#4a90c8' }
];

/** A UTC day as YYYY-MM-DD. */
export function utcDay(ms: number): string {
  return new Date(ms).toISOString().slice(0, 10);
}

/**
 * The window [from, to) of a range, in epoch seconds: today (UTC) so far, the last 7 or 30 UTC days
 * (today included), or whole UTC days from `first` to `last` (both included). `to` null: up to now
 * (the server's clock). An error in words for a custom range that cannot be asked for.
 */
export function rangeWindow(
  range: Range,
  nowMs: number,
  first: string,
  last: string
): { from: number; to: number | null } | { error: string } {
  const today = Math.floor(nowMs / DAY_MS) * DAY_MS;
  if (range !== 'custom') {
    const days = range === 'today' ? 1 : range === '7d' ? 7 : 30;
    return { from: (today - (days - 1) * DAY_MS) / 1000, to: null };
  }
  const lo = Date.parse(`${first}T00:00:00Z`);
  const hi = Date.parse(`${last}T00:00:00Z`);
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) {
    return { error: 'Pick the first and the last day of the range.' };
  }
  if (hi < lo) {
    return { error: `The last day (${last}) is before the first (${first}): pick a last day on or after it.` };
  }
  return { from: lo / 1000, to: (hi + DAY_MS) / 1000 };
}

/** The unit GPU-time is shown in: hours, unless everything shown is under an hour (then minutes or seconds). */
export interface IUnit {
  name: string; // "GPU-hours"
  seconds: number;
}

export function gpuUnit(largestGpuS: number): IUnit {
  if (largestGpuS >= 3600) {
    return { name: 'GPU-hours', seconds: 3600 };
  }
  if (largestGpuS >= 60) {
    return { name: 'GPU-minutes', seconds: 60 };
  }
  return { name: 'GPU-seconds', seconds: 1 };
}

/** GPU-seconds in `unit`, to 2 decimals under 10, 1 under 100, whole above. */
export function gpuTime(gpuS: number, unit: IUnit): string {
  const v = gpuS / unit.seconds;
  return v.toFixed(Math.abs(v) < 10 ? 2 : Math.abs(v) < 100 ? 1 : 0);
}

/** A wait in words, as `gpulease report` writes it: "-" for none, then ms, s, min or h. */
export function waitText(ms: number | null): string {
  if (ms === null) {
    return '-';
  }
  if (ms < 1000) {
    return `${ms.toFixed(0)} ms`;
  }
  if (ms < 90_000) {
    return `${(ms / 1000).toFixed(ms < 10_000 ? 1 : 0)} s`;
  }
  if (ms < 5_400_000) {
    return `${(ms / 60_000).toFixed(0)} min`;
  }
  return `${(ms / 3_600_000).toFixed(1)} h`;
}

function pct(v: number | null): string {
  return v === null ? '-' : `${v.toFixed(0)}%`;
}

/** Held GPU-time split into used, held idle (sampled, not busy), not measured (not sampled) and warm. */
export function parts(f: IUsageFigures): Record<string, number> {
  return {
    used: f.used_gpu_s,
    idle: Math.max(0, f.sampled_gpu_s - f.used_gpu_s),
    unmeasured: Math.max(0, f.held_gpu_s - f.sampled_gpu_s),
    warm: f.warm_gpu_s
  };
}

/** A CSV field: quoted when it holds a comma, a quote or a line break. */
function csvField(v: unknown): string {
  const s = v === null || v === undefined ? '' : String(v);
  return /[",\n\r]/.test(s) ? `"${s.replace(/"/g, '""')}"` : s;
}

export function toCsv(header: string[], rows: unknown[][]): string {
  return [header, ...rows].map(r => r.map(csvField).join(',')).join('\n') + '\n';
}

/** Offer `text` as a file download (a link clicked, then revoked). */
function download(name: string, text: string): void {
  const url = URL.createObjectURL(new Blob([text], { type: 'text/csv' }));
  const a = document.createElement('a');
  a.href = url;
  a.download = name;
  document.body.appendChild(a);
  a.click();
  a.remove();
  window.setTimeout(() => URL.revokeObjectURL(url), 1000);
}

/** One column of a table: its title, how a row shows it, and (for the CSV) its raw value. */
interface IColumn<R> {
  title: string;
  show: (row: R) => React.ReactNode;
  csv?: (row: R) => unknown;
  numeric?: boolean;
}

/**
 * The table under a chart: the chart's figures for keyboard and screen-reader users, and a CSV of
 * them (the server's own figures and units: GPU-seconds, milliseconds), named `file`.
 */
function FigureTable<R>(props: {
  caption: string;
  columns: IColumn<R>[];
  rows: R[];
  rowKey: (row: R) => string;
  file: string;
  csvHeader: string[];
  csvRows: unknown[][];
}): JSX.Element {
  const { caption, columns, rows, rowKey, file, csvHeader, csvRows } = props;
  return (
    <div className="jp-GpuLease-usageTableWrap">
      <table className="jp-GpuLease-usageTable">
        <caption>{caption}</caption>
        <thead>
          <tr>
            {columns.map(c => (
              <th key={c.title} scope="col" className={c.numeric ? 'jp-GpuLease-num' : ''}>
                {c.title}
              </th>
            ))}
          </tr>
        </thead>
        <tbody>
          {rows.map(r => (
            <tr key={rowKey(r)}>
              {columns.map((c, i) =>
                i === 0 ? (
                  <th key={c.title} scope="row">
                    {c.show(r)}
                  </th>
                ) : (
                  <td key={c.title} className={c.numeric ? 'jp-GpuLease-num' : ''}>
                    {c.show(r)}
                  </td>
                )
              )}
            </tr>
          ))}
        </tbody>
      </table>
      <button
        className="jp-mod-styled jp-GpuLease-csv"
        aria-label={`Download CSV: ${caption}`}
        onClick={() => download(file, toCsv(csvHeader, csvRows))}
      >
        Download CSV
      </button>
    </div>
  );
}

/** The width of an element, followed as the panel is resized. */
function useWidth(ref: React.RefObject<HTMLElement>): number | null {
  // null until measured: a chart is drawn once, at its real width (drawn first at a guess, every
  // chart was drawn twice as the tab opened)
  const [width, setWidth] = useState<number | null>(null);
  useEffect(() => {
    const el = ref.current;
    if (!el) {
      return;
    }
    const seen = () => setWidth(Math.max(320, Math.floor(el.clientWidth)));
    seen();
    const observer = new ResizeObserver(seen);
    observer.observe(el);
    return () => observer.disconnect();
  }, [ref]);
  return width;
}

/**
 * An Observable Plot chart: `make(width)` draws it (again when the width or `data`, what it draws,
 * change). Its pointer value, when the chart has one, is passed to `onPick` on a click (the
 * drill-down).
 */
function Chart(props: {
  label: string;
  make: (width: number) => (SVGSVGElement | HTMLElement) & Plot.Plot;
  data: unknown;
  onPick?: (value: Record<string, unknown>) => void;
}): JSX.Element {
  const { label, make, data, onPick } = props;
  const box = useRef<HTMLDivElement>(null);
  const width = useWidth(box);
  // make and onPick are new functions at every render: the newest are used, but the chart is drawn
  // again only when what it draws (data) or its width changes.
  const latest = useRef({ make, onPick });
  useEffect(() => {
    latest.current = { make, onPick };
  });
  useEffect(() => {
    const el = box.current;
    if (!el || width === null) {
      return;
    }
    const chart = latest.current.make(width);
    el.replaceChildren(chart);
    const pick = () => {
      if (chart.value) {
        latest.current.onPick?.(chart.value);
      }
    };
    chart.addEventListener('click', pick);
    return () => chart.removeEventListener('click', pick);
  }, [width, data]);
  // The table under the chart carries its figures for screen readers; the drawing is an image.
  return <div ref={box} className="jp-GpuLease-chart" role="img" aria-label={label} />;
}

/** Plot options every chart shares: JupyterLab's font and text colour, a transparent background. */
function base(width: number, height = 240): Plot.PlotOptions {
  return {
    width,
    height,
    marginLeft: 56,
    style: {
      background: 'transparent',
      color: 'var(--jp-ui-font-color1)',
      fontFamily: 'var(--jp-ui-font-family)',
      fontSize: '11px',
      overflow: 'visible'
    }
  };
}

/** The day axis: every day a band, a label every few days so that labels never overlap. */
function dayAxis(days: string[], width: number): Plot.ScaleOptions {
  const step = Math.max(1, Math.ceil((days.length * 44) / Math.max(1, width - 80)));
  return {
    type: 'band',
    domain: days,
    label: null,
    ticks: days.filter((_, i) => i % step === 0),
    tickFormat: (d: string) => d.slice(5),
    padding: 0.2
  };
}

/** The groups drawn apart (the largest MOST_GROUPS), the rest summed as "others". */
function topGroups(summary: IUsageSummary): { keys: string[]; of: (key: string) => string } {
  const keys = summary.groups.map(g => g.key);
  if (keys.length <= MOST_GROUPS + 1) {
    return { keys, of: k => k };
  }
  const shown = new Set(keys.slice(0, MOST_GROUPS));
  return { keys: [...keys.slice(0, MOST_GROUPS), OTHERS], of: k => (shown.has(k) ? k : OTHERS) };
}

export interface IQuery {
  range: Range;
  first: string;
  last: string;
  by: By;
  pool: string;
  user: string | null;
}

function queryArgs(q: IQuery, by: By, window: { from: number; to: number | null }): URLSearchParams {
  const args = new URLSearchParams({ from: String(window.from), by });
  if (window.to !== null) {
    args.set('to', String(window.to));
  }
  if (q.pool) {
    args.set('pool', q.pool);
  }
  if (q.user) {
    args.set('user', q.user);
  }
  return args;
}

/**
 * The query of GET /gpulease/usage/summary for the controls and the range's window: grouped as
 * asked (by user once one user is picked), with the same rows by pool in the same answer for the
 * utilisation per pool (one read of them).
 */
export function summaryQuery(q: IQuery, window: { from: number; to: number | null }): string {
  const by: By = q.user ? 'user' : q.by;
  const args = queryArgs(q, by, window);
  if (by !== 'pool') {
    args.set('also_by', 'pool');
  }
  return args.toString();
}

interface ILoaded {
  main: IUsageSummary;
  pools: IUsageSummary;
  ms: number;
}

/** The Usage tab. */
export function UsagePanel(props: { model: GpuLeaseModel }): JSX.Element {
  const { model } = props;
  const today = utcDay(Date.now());
  const [q, setQ] = useState<IQuery>({
    range: '7d',
    first: utcDay(Date.now() - 6 * DAY_MS),
    last: today,
    by: 'user',
    pool: '',
    user: null
  });
  const [loaded, setLoaded] = useState<ILoaded | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);
  const [seq, setSeq] = useState(0);
  const window_ = rangeWindow(q.range, model.serverNow() * 1000, q.first, q.last);
  // What to ask for (null: a range that cannot be asked for): fetched again when it changes.
  const query = 'error' in window_ ? null : summaryQuery(q, window_);

  useEffect(() => {
    if (query === null) {
      setBusy(false); // (a fetch of the range before was dropped)
      return;
    }
    let current = true;
    const started = performance.now();
    setBusy(true);
    model
      .usageSummary(new URLSearchParams(query))
      .then(m => {
        if (current) {
          const p = m.also ? { ...m, by: m.also.by, groups: m.also.groups } : m;
          setLoaded({ main: m, pools: p, ms: performance.now() - started });
          setError(null);
        }
      })
      .catch(err => {
        if (current) {
          setError(describe(err));
        }
      })
      .finally(() => {
        if (current) {
          setBusy(false);
        }
      });
    return () => {
      current = false;
    };
  }, [model, query, seq]);

  const set = useCallback((change: Partial<IQuery>) => setQ(prev => ({ ...prev, ...change })), []);
  const onUser = useCallback((user: string) => set({ user }), [set]);
  const pools = Object.keys(model.cluster?.pools ?? {}).filter(p => p !== model.cluster?.cpu_pool);
  const shown = loaded?.main;
  // The pools shown whose GPUs are simulated: their "used" is not real use (said under the chart).
  // A string, so that the charts (memo) are not drawn again at every tick of the panel.
  const simulated = [
    ...new Set(
      (model.cluster?.nodes ?? [])
        .filter(n => n.source === 'simulated' && n.pool !== model.cluster?.cpu_pool && (!q.pool || n.pool === q.pool))
        .map(n => n.pool)
    )
  ]
    .sort()
    .join(', ');
  return (
    <div
      className="jp-GpuLease-usage"
      aria-busy={busy}
      data-load-ms={loaded && !busy ? loaded.ms.toFixed(0) : undefined}
    >
      <div className="jp-GpuLease-usageControls" role="group" aria-label="Usage range and grouping">
        <div role="radiogroup" aria-label="Range" className="jp-GpuLease-ranges">
          {RANGES.map(r => (
            <button
              key={r.id}
              role="radio"
              aria-checked={q.range === r.id}
              className={`jp-GpuLease-range${q.range === r.id ? ' jp-mod-current' : ''}`}
              onClick={() => set({ range: r.id })}
            >
              {r.label}
            </button>
          ))}
        </div>
        {q.range === 'custom' && (
          <span className="jp-GpuLease-customRange">
            <label>
              From{' '}
              <input
                type="date"
                value={q.first}
                max={today}
                aria-label="First day (UTC)"
                onChange={e => set({ first: e.target.value })}
              />
            </label>
            <label>
              to{' '}
              <input
                type="date"
                value={q.last}
                aria-label="Last day (UTC)"
                onChange={e => set({ last: e.target.value })}
              />
            </label>
            <span className="jp-GpuLease-hint">(UTC days, both included)</span>
          </span>
        )}
        {!q.user && (
          <label>
            By{' '}
            <select value={q.by} aria-label="Group by" onChange={e => set({ by: e.target.value as By })}>
              <option value="user">user</option>
              <option value="team">team</option>
              <option value="pool">pool</option>
            </select>
          </label>
        )}
        <label>
          Pool{' '}
          <select value={q.pool} aria-label="Pool" onChange={e => set({ pool: e.target.value })}>
            <option value="">all pools</option>
            {pools.map(p => (
              <option key={p} value={p}>
                {p}
              </option>
            ))}
          </select>
        </label>
        <button
          className="jp-mod-styled jp-GpuLease-refresh"
          onClick={() => setSeq(seq + 1)}
          disabled={busy}
          title="Fetch the figures again (a lease counts once it has ended)"
        >
          {busy ? 'Loading…' : 'Refresh'}
        </button>
      </div>
      {q.user && (
        <div className="jp-GpuLease-drill">
          <span role="status">
            Showing <strong>{q.user}</strong>&apos;s usage only.
          </span>
          <button className="jp-mod-styled" onClick={() => set({ user: null })}>
            Back to everyone
          </button>
        </div>
      )}
      {'error' in window_ ? (
        <div role="alert" className="jp-GpuLease-error">
          {window_.error}
        </div>
      ) : error ? (
        <div role="alert" className="jp-GpuLease-error">
          could not load usage: {error}{' '}
          <button className="jp-mod-styled" onClick={() => setSeq(seq + 1)}>
            Try again
          </button>
        </div>
      ) : !loaded ? (
        <p className="jp-GpuLease-empty">Loading usage…</p>
      ) : (
        shown && <UsageCharts summary={shown} pools={loaded.pools} onUser={onUser} simulated={simulated} />
      )}
    </div>
  );
}

/** The days of an answer: "2026-11-21 – 2026-11-27 (UTC)". */
function daysLine(s: IUsageSummary): string {
  return `${s.days.length === 1 ? s.days[0] : `${s.days[0]} – ${s.days[s.days.length - 1]}`} (UTC)`;
}

/**
 * How many GPU cells ran, in one word: "8 cells (2 started warm)". A cell that started warm ran on
 * its notebook's warm worker; the others (the server's calls) each asked for GPUs, and waited.
 */
export function cellsText(f: IUsageFigures): string {
  const warm = f.warm_cells ? ` (${f.warm_cells} started warm)` : '';
  return `${f.cells} cell${f.cells === 1 ? '' : 's'}${warm}`;
}

/** The heading line: the range, and the totals in one sentence. */
export function totalsLine(s: IUsageSummary, unit: IUnit): string {
  const t = s.total;
  const used = t.util_pct === null ? 'nothing sampled' : `${pct(t.util_pct)} of sampled time used`;
  return (
    `${daysLine(s)}: ${cellsText(t)}, ${gpuTime(t.held_gpu_s, unit)} ${unit.name} held ` +
    `(${used}), ${gpuTime(t.warm_gpu_s, unit)} warm; wait p50 ${waitText(t.wait_p50_ms)}, p95 ${waitText(t.wait_p95_ms)}`
  );
}

/**
 * The line under the chart of what the GPU time was: why "used" reads 0 % on simulated GPUs (the
 * pools named), and what warm time is and why it may dwarf the time held. Empty: nothing to say.
 */
export function splitNote(s: IUsageSummary, simulated: string): string {
  const lines: string[] = [];
  if (simulated) {
    lines.push(
      `The GPUs of ${simulated} are simulated: nothing runs on them, so their samples show the load an admin ` +
        'sets (gpulease simulate util), 0 % unless set, and "used" there is not what your cells did.'
    );
  }
  if (s.total.warm_gpu_s > 0) {
    const more = s.total.warm_gpu_s > s.total.held_gpu_s ? ' (so it can be more than the time held)' : '';
    lines.push(
      "Warm: a warm worker keeps a notebook's model on its GPU between cells, from one cell's end to the " +
        `next${more}; the GPU is lent to anyone who waits meanwhile, and warm time is not charged as use.`
    );
  }
  return lines.join(' ');
}

/** The charts and tables of one answer (drawn again only when the answer changes, not on the panel's ticks). */
const UsageCharts = React.memo(function UsageCharts(props: {
  summary: IUsageSummary;
  pools: IUsageSummary;
  onUser: (user: string) => void;
  /** The pools shown whose GPUs are simulated, named ("A100-80GB, T4-16GB"); empty: none. */
  simulated: string;
}): JSX.Element {
  const { summary: s, pools, onUser, simulated } = props;
  const largest = Math.max(
    0,
    ...s.daily.map(d => d.held_gpu_s + d.warm_gpu_s),
    ...s.groups.map(g => g.total.held_gpu_s + g.total.warm_gpu_s)
  );
  const unit = gpuUnit(largest);
  const own = s.scope === 'own' ? ' This server shows you only your own usage (usage_own_rows_only).' : '';
  // (calls count in the hour a lease was granted: a range holding only the tail of a long lease
  // has GPU time and no call, and its charts are drawn)
  if (s.total.calls === 0 && s.total.held_gpu_s + s.total.warm_gpu_s === 0 && s.groups.length === 0) {
    return (
      <>
        <p className="jp-GpuLease-usageTotals">{daysLine(s)}</p>
        <p className="jp-GpuLease-empty" role="status">
          No GPU use in this range yet — run a %%gpu_train cell, or pick a longer range. (A lease counts once it has
          ended.){own}
        </p>
      </>
    );
  }
  const by = s.user ? 'user' : s.by;
  return (
    <>
      <p className="jp-GpuLease-usageTotals">
        {totalsLine(s, unit)}
        {own}
      </p>
      <HeldByGroup s={s} by={by} unit={unit} onUser={s.user ? undefined : onUser} />
      <HeldSplit s={s} unit={unit} simulated={simulated} />
      <Utilisation pools={pools} />
      <Waits s={s} by={by} />
      <TakenBack s={s} unit={unit} />
    </>
  );
});

function HeldByGroup(props: { s: IUsageSummary; by: By; unit: IUnit; onUser?: (user: string) => void }): JSX.Element {
  const { s, by, unit, onUser } = props;
  const { keys, of } = topGroups(s);
  const data = s.groups.flatMap(g =>
    g.daily.map(d => ({ day: d.day, group: of(g.key), key: g.key, v: (d.held_gpu_s + d.warm_gpu_s) / unit.seconds }))
  );
  const drillable = by === 'user' && !!onUser;
  const title = `${unit.name} per day, by ${by} (held + warm)`;
  return (
    <section className="jp-GpuLease-usageSection" aria-label={title}>
      <h3 className="jp-GpuLease-heading">{title}</h3>
      {drillable && <p className="jp-GpuLease-hint">Click a user&apos;s bars, or their name in the table, for their usage.</p>}
      <Chart
        label={`${title}: stacked bars, the figures are in the table below`}
        data={s}
        onPick={
          drillable
            ? v => {
                if (typeof v.key === 'string' && v.key && v.key !== '~other') {
                  onUser?.(v.key);
                }
              }
            : undefined
        }
        make={width =>
          Plot.plot({
            ...base(width),
            x: dayAxis(s.days, width),
            y: { label: unit.name, grid: true },
            color: { domain: keys, legend: true },
            marks: [
              Plot.barY(data, {
                x: 'day',
                y: 'v',
                fill: 'group',
                order: keys,
                tip: { format: { x: true, y: (v: number) => v.toFixed(2), fill: true } },
                channels: { key: { value: 'key', label: by } }
              }),
              Plot.ruleY([0])
            ]
          })
        }
      />
      <FigureTable
        caption={`${title}: each ${by}'s totals in the range`}
        rowKey={g => g.key}
        rows={s.groups}
        columns={[
          {
            title: by,
            show: g =>
              drillable && g.key !== '~other' ? (
                <button
                  className="jp-GpuLease-linkButton"
                  aria-label={`Show ${g.key}'s usage`}
                  onClick={() => onUser?.(g.key)}
                >
                  {g.key}
                </button>
              ) : (
                g.key
              )
          },
          { title: 'cells', show: g => g.total.cells, numeric: true },
          { title: `held (${unit.name})`, show: g => gpuTime(g.total.held_gpu_s, unit), numeric: true },
          {
            // nothing sampled: not measured, not 0 (as gpulease report shows it)
            title: 'used',
            show: g => (g.total.sampled_gpu_s ? gpuTime(g.total.used_gpu_s, unit) : '-'),
            numeric: true
          },
          { title: 'util', show: g => pct(g.total.util_pct), numeric: true },
          { title: `warm`, show: g => gpuTime(g.total.warm_gpu_s, unit), numeric: true },
          { title: 'wait p95', show: g => waitText(g.total.wait_p95_ms), numeric: true }
        ]}
        file={`gpu-usage-by-${by}-${s.days[0]}-${s.days[s.days.length - 1]}.csv`}
        csvHeader={[by, 'day', 'cells', 'warm_cells', 'calls', 'held_gpu_s', 'used_gpu_s', 'util_pct', 'warm_gpu_s']}
        csvRows={s.groups.flatMap(g =>
          [...g.daily, { ...g.total, day: 'total' }].map(d => [
            g.key,
            d.day,
            d.cells,
            d.warm_cells,
            d.calls,
            d.held_gpu_s,
            d.used_gpu_s,
            d.util_pct,
            d.warm_gpu_s
          ])
        )}
      />
    </section>
  );
}

function HeldSplit(props: { s: IUsageSummary; unit: IUnit; simulated: string }): JSX.Element {
  const { s, unit, simulated } = props;
  const note = splitNote(s, simulated);
  const data = s.daily.flatMap(d => {
    const p = parts(d);
    return PARTS.map(part => ({ day: d.day, part: part.label, v: p[part.key] / unit.seconds }));
  });
  const title = `What the ${unit.name} were: used, held idle, not measured, warm`;
  return (
    <section className="jp-GpuLease-usageSection" aria-label="Held GPU time, split">
      <h3 className="jp-GpuLease-heading">{title}</h3>
      <p className="jp-GpuLease-hint">
        Used: busy by the GPU samples; held idle: sampled, not busy; not measured: no sample; warm: kept for the
        notebook&apos;s next cell, lent to anyone who waits.
      </p>
      <Chart
        label={`${title}: stacked bars per day, the figures are in the table below`}
        data={s}
        make={width =>
          Plot.plot({
            ...base(width),
            x: dayAxis(s.days, width),
            y: { label: unit.name, grid: true },
            color: { domain: PARTS.map(p => p.label), range: PARTS.map(p => p.color), legend: true },
            marks: [
              Plot.barY(data, {
                x: 'day',
                y: 'v',
                fill: 'part',
                order: PARTS.map(p => p.label),
                tip: { format: { y: (v: number) => v.toFixed(2) } }
              }),
              Plot.ruleY([0])
            ]
          })
        }
      />
      {note && (
        <p className="jp-GpuLease-hint jp-GpuLease-chartNote" role="note" aria-label="What used and warm mean here">
          {note}
        </p>
      )}
      <FigureTable<IUsageDay>
        caption={`${title}, per day`}
        rowKey={d => d.day}
        rows={s.daily}
        columns={[
          { title: 'day', show: d => d.day },
          { title: `held (${unit.name})`, show: d => gpuTime(d.held_gpu_s, unit), numeric: true },
          ...PARTS.map(part => ({
            title: part.label,
            show: (d: IUsageDay) => gpuTime(parts(d)[part.key], unit),
            numeric: true
          })),
          { title: 'util', show: d => pct(d.util_pct), numeric: true }
        ]}
        file={`gpu-usage-split-${s.days[0]}-${s.days[s.days.length - 1]}.csv`}
        csvHeader={['day', 'held_gpu_s', 'used_gpu_s', 'idle_gpu_s', 'unmeasured_gpu_s', 'warm_gpu_s', 'util_pct']}
        csvRows={[...s.daily, { ...s.total, day: 'total' }].map(d => {
          const p = parts(d);
          return [d.day, d.held_gpu_s, p.used, p.idle, p.unmeasured, p.warm, d.util_pct];
        })}
      />
    </section>
  );
}

function Utilisation(props: { pools: IUsageSummary }): JSX.Element {
  const { pools: s } = props;
  const data = s.groups.flatMap(g =>
    g.daily.filter(d => d.util_pct !== null).map(d => ({ day: d.day, pool: g.key, util: d.util_pct as number }))
  );
  const title = 'Utilisation of held GPUs per pool (% of sampled GPU-time busy)';
  return (
    <section className="jp-GpuLease-usageSection" aria-label="Utilisation per pool">
      <h3 className="jp-GpuLease-heading">{title}</h3>
      {data.length === 0 ? (
        <p className="jp-GpuLease-empty">
          No GPU was sampled in this range: utilisation needs a node agent&apos;s samples (gpulease agent).
        </p>
      ) : (
        <Chart
          label={`${title}: lines per pool, the figures are in the table below`}
          data={s}
          make={width =>
            Plot.plot({
              ...base(width, 200),
              x: { ...dayAxis(s.days, width), type: 'point' },
              y: { label: 'util %', domain: [0, 100], grid: true },
              color: { domain: s.groups.map(g => g.key), legend: true },
              marks: [
                Plot.line(data, { x: 'day', y: 'util', stroke: 'pool', z: 'pool' }),
                Plot.dot(data, { x: 'day', y: 'util', fill: 'pool', tip: true })
              ]
            })
          }
        />
      )}
      <FigureTable<IUsageDay>
        caption={`${title}, per day`}
        rowKey={d => d.day}
        rows={s.daily}
        columns={[
          { title: 'day', show: d => d.day },
          ...s.groups.map(g => ({
            title: g.key,
            show: (d: IUsageDay) => pct(g.daily.find(x => x.day === d.day)?.util_pct ?? null),
            numeric: true
          }))
        ]}
        file={`gpu-utilisation-${s.days[0]}-${s.days[s.days.length - 1]}.csv`}
        csvHeader={['pool', 'day', 'sampled_gpu_s', 'used_gpu_s', 'util_pct']}
        csvRows={s.groups.flatMap(g =>
          [...g.daily, { ...g.total, day: 'total' }].map(d => [g.key, d.day, d.sampled_gpu_s, d.used_gpu_s, d.util_pct])
        )}
      />
    </section>
  );
}

function Waits(props: { s: IUsageSummary; by: By }): JSX.Element {
  const { s, by } = props;
  const data = s.daily.flatMap(d =>
    (
      [
        ['p50', d.wait_p50_ms],
        ['p95', d.wait_p95_ms]
      ] as [string, number | null][]
    )
      .filter(([, v]) => v !== null)
      .map(([q, v]) => ({ day: d.day, q, s: (v as number) / 1000 }))
  );
  const longest = [...s.groups]
    .filter(g => g.total.wait_p95_ms !== null)
    .sort((a, b) => (b.total.wait_p95_ms ?? 0) - (a.total.wait_p95_ms ?? 0));
  const title = 'Time to GPU: median (p50) and 95th percentile (p95) wait per day';
  return (
    <section className="jp-GpuLease-usageSection" aria-label="Waits">
      <h3 className="jp-GpuLease-heading">{title}</h3>
      <p className="jp-GpuLease-hint">
        A cell that starts warm waits for nothing: these are the waits of the cold cells, those that asked for GPUs.
      </p>
      <Chart
        label={`${title}: two lines, the figures are in the table below`}
        data={s}
        make={width =>
          Plot.plot({
            ...base(width, 200),
            x: { ...dayAxis(s.days, width), type: 'point' },
            y: { label: 'wait (s)', grid: true, zero: true },
            color: { domain: ['p50', 'p95'], range: ['#4a90c8', '#d1495b'], legend: true },
            marks: [
              Plot.line(data, { x: 'day', y: 's', stroke: 'q', z: 'q' }),
              Plot.dot(data, { x: 'day', y: 's', fill: 'q', tip: true })
            ]
          })
        }
      />
      <FigureTable<IUsageDay>
        caption={`${title}`}
        rowKey={d => d.day}
        rows={s.daily}
        columns={[
          { title: 'day', show: d => d.day },
          { title: 'cold cells', show: d => d.calls, numeric: true },
          { title: 'p50', show: d => waitText(d.wait_p50_ms), numeric: true },
          { title: 'p95', show: d => waitText(d.wait_p95_ms), numeric: true },
          { title: 'mean', show: d => waitText(d.wait_mean_ms), numeric: true }
        ]}
        file={`gpu-waits-${s.days[0]}-${s.days[s.days.length - 1]}.csv`}
        csvHeader={['day', 'waits', 'wait_p50_ms', 'wait_p95_ms', 'wait_mean_ms']}
        csvRows={[...s.daily, { ...s.total, day: 'total' }].map(d => [
          d.day,
          d.waits,
          d.wait_p50_ms,
          d.wait_p95_ms,
          d.wait_mean_ms
        ])}
      />
      <h4 className="jp-GpuLease-subheading">Who waited longest</h4>
      <FigureTable
        caption={`Waits per ${by}, the longest p95 first`}
        rowKey={g => g.key}
        rows={longest}
        columns={[
          { title: by, show: g => g.key },
          { title: 'cold cells', show: g => g.total.calls, numeric: true },
          { title: 'p50', show: g => waitText(g.total.wait_p50_ms), numeric: true },
          { title: 'p95', show: g => waitText(g.total.wait_p95_ms), numeric: true },
          { title: 'mean', show: g => waitText(g.total.wait_mean_ms), numeric: true }
        ]}
        file={`gpu-waits-by-${by}-${s.days[0]}-${s.days[s.days.length - 1]}.csv`}
        csvHeader={[by, 'waits', 'wait_p50_ms', 'wait_p95_ms', 'wait_mean_ms']}
        csvRows={longest.map(g => [
          g.key,
          g.total.waits,
          g.total.wait_p50_ms,
          g.total.wait_p95_ms,
          g.total.wait_mean_ms
        ])}
      />
    </section>
  );
}

function TakenBack(props: { s: IUsageSummary; unit: IUnit }): JSX.Element {
  const { s, unit } = props;
  const data = s.daily.flatMap(d => [
    { day: d.day, how: 'reclaimed', v: d.reclaimed_gpu_s / unit.seconds },
    { day: d.day, how: 'evicted (warm, lent out)', v: d.evicted_gpu_s / unit.seconds }
  ]);
  const title = `${unit.name} taken back, and cells that started warm`;
  return (
    <section className="jp-GpuLease-usageSection" aria-label="Taken back and warm cells">
      <h3 className="jp-GpuLease-heading">{title}</h3>
      <p className="jp-GpuLease-hint">
        Reclaimed: idle reclaim, a booking&apos;s recall or a preemption; evicted: a warm lease lent to a waiting request.
        Warm share: cells that ran on their notebook&apos;s warm worker. In total {pct(share(s.total))} of{' '}
        {s.total.cells} cell{s.total.cells === 1 ? '' : 's'} started warm.
      </p>
      <Chart
        label={`${title}: stacked bars per day, the figures are in the table below`}
        data={s}
        make={width =>
          Plot.plot({
            ...base(width, 180),
            x: dayAxis(s.days, width),
            y: { label: unit.name, grid: true },
            color: {
              domain: ['reclaimed', 'evicted (warm, lent out)'],
              range: ['#d1495b', '#4a90c8'],
              legend: true
            },
            marks: [Plot.barY(data, { x: 'day', y: 'v', fill: 'how', tip: true }), Plot.ruleY([0])]
          })
        }
      />
      <FigureTable<IUsageDay>
        caption={`${title}, per day`}
        rowKey={d => d.day}
        rows={s.daily}
        columns={[
          { title: 'day', show: d => d.day },
          { title: `reclaimed (${unit.name})`, show: d => gpuTime(d.reclaimed_gpu_s, unit), numeric: true },
          { title: 'evicted', show: d => gpuTime(d.evicted_gpu_s, unit), numeric: true },
          { title: 'cells', show: d => d.cells, numeric: true },
          { title: 'warm cells', show: d => d.warm_cells, numeric: true },
          { title: 'warm share', show: d => pct(share(d)), numeric: true }
        ]}
        file={`gpu-taken-back-${s.days[0]}-${s.days[s.days.length - 1]}.csv`}
        csvHeader={['day', 'reclaimed_gpu_s', 'evicted_gpu_s', 'cells', 'warm_cells', 'warm_cell_share']}
        csvRows={[...s.daily, { ...s.total, day: 'total' }].map(d => [
          d.day,
          d.reclaimed_gpu_s,
          d.evicted_gpu_s,
          d.cells,
          d.warm_cells,
          d.warm_cell_share
        ])}
      />
    </section>
  );
}

function share(f: IUsageFigures): number | null {
  return f.warm_cell_share === null ? null : 100 * f.warm_cell_share;
}
