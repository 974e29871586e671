/**
 * The "GPU Leases" panel, in three tabs. Board: the GPU board (nodes x GPUs, live), my leases with
 * Release buttons and my bookings with Cancel / End now. Calendar: everyone's bookings (calendar.tsx).
 * Usage: charts and tables of who held the GPUs, used them and waited (usage.tsx).
 * A lease that idle reclaim warned shows its countdown, and (if it is mine) a "Still using it" button;
 * a recalled lease (borrowed from a booking whose holder now wants it, or preempted for a request
 * within quota) shows when it is revoked.
 */
import { ReactWidget } from '@jupyterlab/ui-components';
import React, { useEffect, useReducer, useRef, useState } from 'react';

import { IBooking, ICluster, IGpu, IHolder, ILease, INode, ISlice } from './api';
import { confirmCancelBooking } from './bookingform';
import { BookingCalendar, ICalendarPlace } from './calendar';
import { formatWindow, gpuCount } from './clock';
import { confirmAction } from './confirm';
import { BOARD_PAGE, GpuLeaseModel, LiveState, duration, memSize, reclaimCountdown } from './model';
import { UsagePanel } from './usage';

/**
 * How each GPU state looks: free, leased, reserved (free but held back for a booking now), borrowed
 * (leased from a booking's capacity: revoked with a notice when the booking's holder asks), idle
 * (a leased GPU that idle reclaim warned), draining (the server ended its lease: free once its node
 * agent sees the old processes gone), warm (a finished cell's worker kept for its notebook's next
 * cell: lent out the moment someone waits), sliced (shared by slices, each a lease of part of its
 * memory: drawn as its slices; a slice whose processes use more than it was promised is drawn
 * "over"), down. Each state is named in words on its tile, never by colour alone; the colours are
 * the theme's (base.css), tinted so that text reads at 4.5:1 or more in light and dark themes.
 */
export const STATES: Record<string, { label: string; legend: boolean }> = {
  free: { label: 'free', legend: true },
  leased: { label: 'leased', legend: true },
  warm: { label: 'warm · lendable', legend: true },
  reserved: { label: 'reserved', legend: true },
  borrowed: { label: 'borrowed', legend: true },
  idle: { label: 'idle', legend: false },
  draining: { label: 'draining', legend: true },
  sliced: { label: 'sliced · shared', legend: false },
  over: { label: 'slice over its memory', legend: false },
  down: { label: 'down', legend: true }
};

/**
 * The countdown of a recalled lease (the server set its recall_at): "recalled — revoked in 27 s"
 * for a borrowed lease whose booking's holder asked for the GPUs (borrow_recalled), "preempted —
 * revoked in 27 s" for a lease above quota preempted for a request within it (preempt_notice).
 */
export function recallCountdown(recallAt: number, now: number, borrowed: boolean): string {
  const what = borrowed ? 'recalled' : 'preempted';
  const s = Math.floor(recallAt - now);
  return s <= 0 ? `${what} — revoked now` : `${what} — revoked in ${s < 60 ? `${s} s` : duration(s)}`;
}

function stateLabel(state: string): string {
  return STATES[state]?.label ?? state;
}

const LIVE_TEXT: Record<LiveState, string> = {
  connecting: 'connecting…',
  live: 'live',
  reconnecting: 'reconnecting…',
  stopped: 'not connected'
};

/** Re-render on every model change, and every second while shown (times held tick). */
function useModel(model: GpuLeaseModel): void {
  const [, bump] = useReducer((n: number) => n + 1, 0);
  useEffect(() => {
    const onChange = () => bump();
    model.changed.connect(onChange);
    const ticker = window.setInterval(onChange, 1000);
    return () => {
      model.changed.disconnect(onChange);
      window.clearInterval(ticker);
    };
  }, [model]);
}

/**
 * What a GPU tile says about its lease's origin: "train.ipynb · cell 4" when the lease carries its
 * notebook (and cell), else its label (the cell's first line). The label goes to the tooltip.
 * The cluster view may not carry notebook and cell: my own leases (GET /gpulease/leases) do.
 */
export function holderOrigin(holder: IHolder, mine: ILease | undefined): { text: string; title: string } | null {
  const notebook = holder.notebook || mine?.notebook || '';
  const cell = holder.cell || mine?.cell || '';
  const label = holder.label || mine?.label || '';
  if (!notebook) {
    return label ? { text: label, title: label } : null;
  }
  const name = notebook.split('/').pop() || notebook;
  // A cell number (the magic sends In [n]'s n) reads as one; a hash of a cell's source (run_cell
  // outside a kernel) is only a tooltip detail.
  const numbered = /^\d+$/.test(cell);
  const text = numbered ? `${name} · cell ${cell}` : name;
  const title = [label, cell && !numbered ? `cell ${cell}` : ''].filter(Boolean).join(' · ') || text;
  return { text, title };
}

/** The "Still using it" button of an idle-warned lease of mine (in My leases and on the board). */
function KeepButton(props: { model: GpuLeaseModel; id: string; where: string; small?: boolean }): JSX.Element {
  const { model, id, where, small } = props;
  const busy = model.keeping.has(id);
  const failed = model.keepErrors.get(id);
  return (
    <button
      className={`jp-mod-styled jp-mod-accept jp-GpuLease-keep${small ? ' jp-GpuLease-keepSmall' : ''}`}
      aria-label={`Still using it: keep lease ${id} (${where})`}
      title={failed ?? 'Reset the idle clock: the GPUs stay yours (a limited number of times per lease)'}
      disabled={busy}
      onClick={() => void model.keep(id)}
    >
      {busy ? 'Keeping…' : 'Still using it'}
    </button>
  );
}

/** A slice whose processes use more memory than it was promised: its agent warns, then ends it if it stays over. */
export function overMemory(s: ISlice): boolean {
  return s.mem_used_mb !== undefined && s.mem_used_mb > s.gpu_mem_mb;
}

/**
 * What one slice's lines say: "bob · 10 GB of 80 GB" (" · warm" while its worker waits for its
 * notebook's next cell, " · taken back in 2s" once someone who waits takes it, " · over its
 * memory" while its processes use more than it was promised), then "using 3 GB, peak 3.9 GB" once
 * its node agent measured it; its accessible name, with how long it is held and its label; and the
 * state it is drawn in (over, warm or leased).
 */
export function sliceText(
  s: ISlice,
  totalMb: number,
  you: boolean,
  now: number
): { head: string; used: string; name: string; state: 'leased' | 'warm' | 'over' } {
  const who = `${s.user}${you ? ' (you)' : ''}`;
  const size = `${memSize(s.gpu_mem_mb)} of ${memSize(totalMb)}`;
  const used =
    s.mem_used_mb === undefined ? '' : `using ${memSize(s.mem_used_mb)}, peak ${memSize(s.mem_peak_mb ?? s.mem_used_mb)}`;
  const over = overMemory(s);
  let state = '';
  let says = '';
  if (s.recall_at) {
    state = ` · taken back in ${duration(Math.max(0, s.recall_at - now))}`;
    says = `taken back in ${duration(Math.max(0, s.recall_at - now))}`;
  } else if (s.warm_since) {
    state = ' · warm';
    says = `kept warm ${duration(now - s.warm_since)}, lent out if someone waits`;
  }
  if (over) {
    state += ' · over its memory';
    says = [`over its memory: ended if it stays over`, says].filter(Boolean).join(', ');
  }
  const name = [`${who}, ${size}`, used, says, `held ${duration(now - s.since)}`, s.label ? `label ${s.label}` : '']
    .filter(Boolean)
    .join(', ');
  return { head: `${who} · ${size}${state}`, used, name, state: over ? 'over' : s.warm_since ? 'warm' : 'leased' };
}

/**
 * A GPU shared by slices: a row per slice that holds its text (its holder, its memory of the
 * GPU's, its state in words, what it uses and its peak where known), under it a meter as wide as
 * its share of the GPU's memory (and what it uses, where measured); the slices still draining;
 * and the memory no slice holds ("unpromised": room for another slice).
 */
function SlicedCell(props: { model: GpuLeaseModel; node: INode; gpu: IGpu; now: number }): JSX.Element {
  const { model, node, gpu, now } = props;
  const mem = gpu.slice_mem ?? { total_mb: gpu.memory_mb ?? 0, used_mb: 0, free_mb: 0 };
  const slices = gpu.slices ?? [];
  const draining = gpu.slices_draining ?? [];
  const where = `${node.name} GPU ${gpu.index}`;
  const mine = slices.some(s => s.user === model.user);
  const count = `${slices.length} slice${slices.length === 1 ? '' : 's'}`;
  const name = `${where}: ${stateLabel('sliced')}, ${count}, ${memSize(mem.free_mb)} of ${memSize(mem.total_mb)} unpromised`;
  const util = gpu.sample ? ` · ${Math.round(gpu.sample.util)}% busy` : '';
  const width = (mb: number) => `${Math.max(2, Math.min(100, (100 * mb) / Math.max(1, mem.total_mb)))}%`;
  return (
    <td
      role="cell"
      className={`jp-GpuLease-cell jp-GpuLease-state-sliced${mine ? ' jp-GpuLease-mine' : ''}`}
      aria-label={name}
      title={`${gpu.model ?? ''} · shared by ${count}${util}`}
      data-state="sliced"
    >
      <div className="jp-GpuLease-cellIndex">GPU {gpu.index} · sliced</div>
      <ul className="jp-GpuLease-slices" aria-label={`slices of ${where}`}>
        {slices.map(s => {
          const you = s.user === model.user;
          const { head, used, name, state } = sliceText(s, mem.total_mb, you, now);
          return (
            <li
              key={s.lease}
              className={`jp-GpuLease-slice jp-GpuLease-slice-${state}${you ? ' jp-GpuLease-mine' : ''}`}
              data-state={state}
              aria-label={`slice ${s.lease}: ${name}`}
              title={`${s.lease}${s.label ? ` · ${s.label}` : ''} · expires in ${duration(s.expires_at - now)} unless renewed`}
            >
              <div className="jp-GpuLease-sliceText">{head}</div>
              {used && <div className="jp-GpuLease-sliceText jp-GpuLease-sliceUsed">{used}</div>}
              <div className="jp-GpuLease-sliceMeter" aria-hidden="true">
                <span className="jp-GpuLease-sliceShare" style={{ width: width(s.gpu_mem_mb) }} />
                {s.mem_used_mb !== undefined && (
                  <span className="jp-GpuLease-sliceUse" style={{ width: width(s.mem_used_mb) }} />
                )}
              </div>
            </li>
          );
        })}
        {draining.map(d => (
          <li
            key={d.lease}
            className="jp-GpuLease-slice jp-GpuLease-slice-draining"
            data-state="draining"
            aria-label={`slice ${d.lease}: ${d.user}'s, ${memSize(d.gpu_mem_mb)} draining: free once its processes are gone`}
          >
            <div className="jp-GpuLease-sliceText">
              {d.user} · {memSize(d.gpu_mem_mb)} · draining
            </div>
          </li>
        ))}
      </ul>
      <div className="jp-GpuLease-cellLabel jp-GpuLease-sliceFree">
        {memSize(mem.free_mb)} of {memSize(mem.total_mb)} unpromised
      </div>
    </td>
  );
}

/**
 * A node's suspended workers, in a row of their own under its GPUs: each an evicted warm worker
 * whose GPU state waits in host memory for its notebook's next cell ("alice · 3.2 GB on host ·
 * 2m05s").
 */
function SuspendedRow(props: { model: GpuLeaseModel; node: INode; now: number }): JSX.Element | null {
  const { model, node, now } = props;
  const workers = node.suspended ?? [];
  if (workers.length === 0) {
    return null;
  }
  return (
    <tr role="row" className="jp-GpuLease-suspendedRow" aria-label={`${node.name}: suspended workers`}>
      <th scope="row" role="rowheader" className="jp-GpuLease-suspendedHead">
        suspended · on host
      </th>
      <td role="cell" className="jp-GpuLease-suspendedCell">
        <ul className="jp-GpuLease-suspended" aria-label={`workers suspended on ${node.name}`}>
          {workers.map(w => {
            const you = w.user === model.user;
            const size = memSize(w.bytes / 2 ** 20);
            const ends = w.until ? `, ended in ${duration(w.until - now)} unless its notebook runs a cell` : '';
            return (
              <li
                key={w.lease}
                className={`jp-GpuLease-suspendedWorker${you ? ' jp-GpuLease-mine' : ''}`}
                data-state="suspended"
                aria-label={
                  `${w.user}${you ? ' (you)' : ''}: a worker suspended ${duration(now - w.since)} ago, ` +
                  `${size} of GPU state on host, restored by its notebook's next cell${ends}`
                }
                title={`left lease ${w.lease} · its notebook's next cell restores it onto a GPU of ${node.name}`}
              >
                {`${w.user}${you ? ' (you)' : ''} · ${size} on host · ${duration(now - w.since)}`}
              </li>
            );
          })}
        </ul>
      </td>
    </tr>
  );
}

/**
 * What a (whole) GPU's tile says: the state it is drawn in (a leased GPU that idle reclaim warned
 * is drawn idle), its accessible name (state, holder or booking, countdowns, draining) and its
 * tooltip, with what the tile shows besides.
 */
export function gpuTileText(
  model: GpuLeaseModel,
  node: INode,
  gpu: IGpu,
  now: number
): {
  state: string;
  name: string;
  title: string;
  mine: boolean;
  held: string;
  idle: boolean;
  origin: { text: string; title: string } | null;
  bookingMine: boolean;
} {
  const lease = gpu.lease;
  const mine = !!lease && lease.user === model.user;
  const held = lease ? duration(now - lease.since) : '';
  const origin = lease ? holderOrigin(lease, model.leases.find(l => l.id === lease.id)) : null;
  // An idle-warned lease is shown as idle: its GPUs go back to the pool at reclaim_at.
  const idle = !!lease?.idle_warning;
  const state = idle && gpu.state === 'leased' ? 'idle' : gpu.state;
  const booking = gpu.reservation;
  const bookingMine =
    !!booking && (model.bookings.find(r => r.id === booking.id)?.mine ?? booking.owner === model.user);
  const parts = [`${node.name} GPU ${gpu.index}: ${stateLabel(gpu.state)}`];
  if (booking && !lease) {
    parts.push(`for ${booking.owner}${bookingMine ? ' (you)' : ''}`);
  }
  if (lease) {
    parts.push(`by ${lease.user}${mine ? ' (you)' : ''}, held ${held}`);
    if (lease.label) {
      parts.push(`label ${lease.label}`);
    }
    if (origin && origin.text !== lease.label) {
      parts.push(`from ${origin.text}`);
    }
    if (idle && lease.reclaim_at) {
      parts.push(reclaimCountdown(lease.reclaim_at, now));
    }
    if (lease.warm_since && !lease.recall_at) {
      parts.push(`kept warm ${duration(now - lease.warm_since)}, lent out if someone waits`);
    }
    if (lease.recall_at) {
      parts.push(
        lease.warm_since
          ? `evicted for a waiting request — free in ${Math.max(0, Math.floor(lease.recall_at - now))} s`
          : recallCountdown(lease.recall_at, now, !!lease.borrowed)
      );
    }
  }
  if (gpu.draining?.state === 'unleased') {
    parts.push('held out of the pool: a process no lease covers uses it');
  } else if (gpu.draining?.abandoned) {
    parts.push(`its agent gave up pid ${gpu.draining.abandoned.pid}: an admin checks it (gpulease drain list)`);
  } else if (gpu.draining) {
    parts.push(`${gpu.draining.user}'s lease ${gpu.draining.state}: free once its processes are gone`);
  }
  if (gpu.unleased_use) {
    parts.push('in use without a lease');
  }
  const util = gpu.sample ? ` · ${Math.round(gpu.sample.util)}% busy` : '';
  const title = lease
    ? `${lease.id}${lease.label ? ` · ${lease.label}` : ''} · expires in ${duration(lease.expires_at - now)} unless renewed${util}`
    : `${gpu.model ?? ''}${util}`;
  return { state, name: parts.join(', '), title, mine, held, idle, origin, bookingMine };
}

function GpuCell(props: { model: GpuLeaseModel; node: INode; gpu: IGpu; now: number }): JSX.Element {
  const { model, node, gpu, now } = props;
  if (gpu.state === 'sliced') {
    return <SlicedCell model={model} node={node} gpu={gpu} now={now} />;
  }
  const lease = gpu.lease;
  const booking = gpu.reservation;
  const { state, name, title, mine, held, idle, origin, bookingMine } = gpuTileText(model, node, gpu, now);
  return (
    <td
      role="cell"
      className={`jp-GpuLease-cell jp-GpuLease-state-${state}${mine ? ' jp-GpuLease-mine' : ''}${gpu.unleased_use ? ' jp-GpuLease-unleased' : ''}`}
      aria-label={name}
      title={title}
      data-state={state}
    >
      <div className="jp-GpuLease-cellIndex">
        GPU {gpu.index}
        {lease?.borrowed ? ' · borrowed' : ''}
        {lease?.warm_since ? ' · warm' : ''}
      </div>
      <div className="jp-GpuLease-cellState">{lease ? lease.user : stateLabel(gpu.state)}</div>
      {booking && !lease && (
        <div className="jp-GpuLease-cellLabel">
          for {booking.owner}
          {bookingMine ? ' (you)' : ''}
        </div>
      )}
      {lease && <div className="jp-GpuLease-cellHeld">{held}</div>}
      {lease?.recall_at && (
        <div className="jp-GpuLease-cellIdle" aria-hidden="true">
          {recallCountdown(lease.recall_at, now, !!lease.borrowed)}
        </div>
      )}
      {origin && (
        <div className="jp-GpuLease-cellLabel jp-GpuLease-cellOrigin" title={origin.title}>
          {origin.text}
        </div>
      )}
      {gpu.unleased_use && <div className="jp-GpuLease-cellLabel">in use without a lease</div>}
      {lease && idle && lease.reclaim_at && (
        <div className="jp-GpuLease-cellIdle" aria-hidden="true">
          {reclaimCountdown(lease.reclaim_at, now)}
        </div>
      )}
      {lease && idle && mine && (
        <>
          <KeepButton model={model} id={lease.id} where={`${node.name} GPU ${gpu.index}`} small />
          {model.keepErrors.has(lease.id) && (
            <div className="jp-GpuLease-cellError" title={model.keepErrors.get(lease.id)}>
              not kept: see My leases
            </div>
          )}
        </>
      )}
    </td>
  );
}

function Board(props: { model: GpuLeaseModel; now: number }): JSX.Element {
  const { model, now } = props;
  const cluster = model.cluster;
  if (!cluster) {
    return <p className="jp-GpuLease-empty">Loading the GPU board…</p>;
  }
  if (cluster.nodes.length === 0 && !model.boardPool) {
    return <p className="jp-GpuLease-empty">No GPU node has registered with the lease server yet.</p>;
  }
  const shown = new Set(
    cluster.nodes.flatMap(n =>
      n.gpus.flatMap(g => [
        g.lease?.idle_warning && g.state === 'leased' ? 'idle' : g.state,
        ...((g.slices ?? []).some(overMemory) ? ['over'] : []),
        ...(g.slices_draining?.length ? ['draining'] : [])
      ])
    )
  );
  const legend = Object.keys(STATES).filter(s => STATES[s].legend || shown.has(s));
  for (const s of shown) {
    if (!legend.includes(s)) {
      legend.push(s);
    }
  }
  return (
    <>
      <BoardPages model={model} cluster={cluster} />
      {/* A row per node; its GPU tiles wrap onto more lines when the panel is narrow. */}
      <table className="jp-GpuLease-board" role="table" aria-label="GPUs by node">
        <tbody role="rowgroup">
          {cluster.nodes.map(node => (
            <React.Fragment key={node.name}>
              <tr role="row" className={node.state === 'down' ? 'jp-GpuLease-nodeDown' : ''}>
                <th scope="row" role="rowheader" className="jp-GpuLease-node">
                  <div className="jp-GpuLease-nodeName">{node.name}</div>
                  <div className="jp-GpuLease-nodePool">
                    {node.pool}
                    {node.state === 'down' ? ' · down' : ''}
                  </div>
                </th>
                {node.gpus.map(gpu => (
                  <GpuCell key={gpu.index} model={model} node={node} gpu={gpu} now={now} />
                ))}
              </tr>
              <SuspendedRow model={model} node={node} now={now} />
            </React.Fragment>
          ))}
        </tbody>
      </table>
      <BoardPages model={model} cluster={cluster} below />
      <ul className="jp-GpuLease-legend" aria-label="legend">
        {legend.map(s => (
          <li key={s}>
            <span
              className={`jp-GpuLease-swatch ${s === 'over' ? 'jp-GpuLease-slice-over' : `jp-GpuLease-state-${s}`}`}
              aria-hidden="true"
            />
            {stateLabel(s)}
          </li>
        ))}
      </ul>
    </>
  );
}

/**
 * Above a board of more nodes than one page: which pool it shows, how many of its nodes, and a
 * button for the next page. A small cluster (one page, no pool chosen) shows none of it.
 */
function BoardPages(props: { model: GpuLeaseModel; cluster: ICluster; below?: boolean }): JSX.Element | null {
  const { model, cluster, below } = props;
  const everyNode = Object.values(cluster.pools).reduce((sum, counts) => sum + (counts.nodes ?? 0), 0);
  if (everyNode <= BOARD_PAGE && !model.boardPool) {
    return null;
  }
  const total = cluster.nodes_total ?? cluster.nodes.length;
  const more = Math.min(BOARD_PAGE, total - cluster.nodes.length);
  const showMore =
    more > 0 ? (
      <button
        className="jp-mod-styled"
        onClick={() => model.setBoardView(model.boardPool, model.boardLimit + BOARD_PAGE)}
      >
        {`Show ${more} more`}
      </button>
    ) : null;
  if (below) {
    // under the last node drawn: the next page where the reader's eye already is
    return showMore ? <div className="jp-GpuLease-boardPages">{showMore}</div> : null;
  }
  return (
    <div className="jp-GpuLease-boardPages">
      <label>
        {'Pool '}
        <select
          aria-label="the board's pool"
          value={model.boardPool ?? ''}
          onChange={e => model.setBoardView(e.target.value || null, BOARD_PAGE)}
        >
          <option value="">every pool</option>
          {Object.keys(cluster.pools)
            .sort()
            .map(pool => (
              <option key={pool} value={pool}>
                {pool}
              </option>
            ))}
        </select>
      </label>
      <span role="status">
        {`${cluster.nodes.length.toLocaleString()} of ${total.toLocaleString()} nodes`}
      </span>
      {showMore}
    </div>
  );
}

function gpuList(lease: ILease): string {
  const slice = lease.gpu_mem_mb
    ? ` · ${memSize(lease.gpu_mem_mb)}${lease.gpu_total_mb ? ` of ${memSize(lease.gpu_total_mb)}` : ''} slice`
    : '';
  return `${lease.node} GPU ${lease.gpus.map(g => g.index).join(', ')}${slice}`;
}

function MyLeases(props: { model: GpuLeaseModel; now: number }): JSX.Element {
  const { model, now } = props;
  if (!model.cluster && model.leases.length === 0) {
    return <></>;
  }
  if (model.leases.length === 0) {
    return <p className="jp-GpuLease-empty">You hold no GPUs.</p>;
  }
  return (
    <ul className="jp-GpuLease-leases" aria-label="leases I hold">
      {model.leases.map(lease => {
        const busy = model.releasing.has(lease.id);
        const failed = model.releaseErrors.get(lease.id);
        const keepFailed = model.keepErrors.get(lease.id);
        return (
          <li key={lease.id} className="jp-GpuLease-lease" aria-label={`lease ${lease.id}`}>
            <div className="jp-GpuLease-leaseText">
              <span className="jp-GpuLease-leaseGpus">{gpuList(lease)}</span>
              <span className="jp-GpuLease-leaseMeta">
                {lease.pool} · held {duration(now - lease.created_at)}
                {lease.borrowed ? ' · borrowed' : ''}
                {lease.label ? ` · ${lease.label}` : ''}
              </span>
              <code className="jp-GpuLease-leaseId">{lease.id}</code>
            </div>
            <button
              className="jp-mod-styled jp-mod-warn jp-GpuLease-release"
              aria-label={`Release lease ${lease.id} (${gpuList(lease)})`}
              disabled={busy}
              onClick={async () => {
                const ok = await confirmAction(
                  `Release lease ${lease.id}?`,
                  `The GPUs of this lease (${gpuList(lease)}${lease.label ? `, ${lease.label}` : ''}) go back ` +
                    'to the pool now: whatever runs on them loses them. This cannot be undone.',
                  'Release'
                );
                if (ok) {
                  await model.release(lease.id);
                }
              }}
            >
              {busy ? 'Releasing…' : 'Release'}
            </button>
            {lease.reclaim_at && (
              <div
                role="group"
                className="jp-GpuLease-warning jp-GpuLease-idle"
                aria-label={`idle warning of lease ${lease.id}`}
              >
                <div className="jp-GpuLease-idleText">
                  <strong className="jp-GpuLease-countdown" role="timer">
                    {reclaimCountdown(lease.reclaim_at, now)}
                  </strong>
                  <span className="jp-GpuLease-idleWhy">
                    these GPUs have been idle: they go back to the pool unless they get busy, or you keep them
                  </span>
                </div>
                <KeepButton model={model} id={lease.id} where={gpuList(lease)} />
              </div>
            )}
            {lease.borrowed && (
              <div className="jp-GpuLease-warning" role="note" aria-label={`borrowed lease ${lease.id}`}>
                {lease.recall_at
                  ? `${recallCountdown(lease.recall_at, now, true)}: the booking these GPUs were borrowed from needs them`
                  : 'borrowed from a booking: revoked with a short notice if its holder asks for the GPUs'}
              </div>
            )}
            {!lease.borrowed && lease.recall_at && (
              <div className="jp-GpuLease-warning" role="note" aria-label={`preempted lease ${lease.id}`}>
                {recallCountdown(lease.recall_at, now, false)}: this lease ran above quota, and a request within
                quota needs its GPUs
              </div>
            )}
            {keepFailed && (
              <div role="alert" className="jp-GpuLease-error">
                {keepFailed}
              </div>
            )}
            {failed && (
              <div role="alert" className="jp-GpuLease-error">
                {failed}
              </div>
            )}
          </li>
        );
      })}
    </ul>
  );
}

function bookingText(r: IBooking, now: number): { when: string; state: string } {
  const next = r.instances.find(i => i.end > now && i.state !== 'released');
  const i = next ?? { start: r.start, end: r.end, state: 'upcoming', k: 0 };
  const later = r.repeat === 'weekly' ? r.occurrences - 1 - ('k' in i ? i.k : 0) : 0;
  const when = `${formatWindow(i.start, i.end)}${later > 0 ? ` (weekly, ${later} more)` : ''}`;
  const state = i.state === 'active' ? `now, ends in ${duration(i.end - now)}` : `starts in ${duration(i.start - now)}`;
  return { when, state };
}

function MyBookings(props: { model: GpuLeaseModel; now: number }): JSX.Element {
  const { model, now } = props;
  // With the lease server away, the alert above says so: the bookings last fetched stay shown.
  if (model.bookingsError && !model.error) {
    return (
      <div role="alert" className="jp-GpuLease-error">
        could not load bookings: {model.bookingsError}
      </div>
    );
  }
  const mine = model.myBookings;
  if (mine.length === 0) {
    return <p className="jp-GpuLease-empty">You have no bookings in the next two weeks.</p>;
  }
  return (
    <ul className="jp-GpuLease-leases" aria-label="my bookings">
      {mine.map(r => {
        const { when, state } = bookingText(r, now);
        const active = r.instances.some(i => i.state === 'active' && i.end > now);
        const busy = model.bookingBusy.has(r.id);
        const failed = model.bookingErrors.get(r.id);
        const what = `${r.pool}, ${gpuCount(r.gpus)}, ${when}`;
        return (
          <li key={r.id} className="jp-GpuLease-lease" aria-label={`booking ${r.id}`}>
            <div className="jp-GpuLease-leaseText">
              <span className="jp-GpuLease-leaseGpus">
                {gpuCount(r.gpus)} of {r.pool}
                {r.owner !== model.user ? ` for ${r.owner}` : ''}
              </span>
              <span className="jp-GpuLease-leaseMeta">
                {when} · {state}
                {r.note ? ` · ${r.note}` : ''}
              </span>
              <code className="jp-GpuLease-leaseId">{r.id}</code>
            </div>
            {active && (
              <button
                className="jp-mod-styled jp-mod-warn"
                aria-label={`End booking ${r.id} now (${what})`}
                title="I'm done: end this occurrence now, its GPUs go back to the pool"
                disabled={busy}
                onClick={() => void model.endBooking(r.id)}
              >
                End now
              </button>
            )}
            <button
              className="jp-mod-styled jp-mod-warn"
              aria-label={`Cancel booking ${r.id} (${what})`}
              title={r.repeat === 'weekly' ? 'Cancel every week of this booking' : 'Cancel this booking'}
              disabled={busy}
              onClick={() => void confirmCancelBooking(model, r)}
            >
              {busy ? 'Working…' : 'Cancel'}
            </button>
            {failed && (
              <div role="alert" className="jp-GpuLease-error">
                {failed}
              </div>
            )}
          </li>
        );
      })}
    </ul>
  );
}

function Queue(props: { model: GpuLeaseModel; now: number }): JSX.Element | null {
  const { model, now } = props;
  if (model.queue.length === 0) {
    return null;
  }
  return (
    <section aria-label="Queue">
      <h3 className="jp-GpuLease-heading">Waiting for GPUs</h3>
      <ol className="jp-GpuLease-queue">
        {model.queue.map(w => (
          <li key={w.id}>
            #{w.position} in {w.pool}: {w.user} wants {w.gpus} GPU{w.gpus === 1 ? '' : 's'}, waiting{' '}
            {duration(now - w.enqueued_at)}
            {w.label ? ` (${w.label})` : ''}
          </li>
        ))}
      </ol>
    </section>
  );
}

/** What a command asked the panel to show: a tab, and the booking form; seq tells requests apart. */
export interface IShowRequest {
  tab: Tab;
  newBooking: boolean;
  seq: number;
}

function GpuLeaseView(props: { model: GpuLeaseModel; request: IShowRequest | null }): JSX.Element {
  const { model, request } = props;
  useModel(model);
  const [tab, setTab] = useState<Tab>(request?.tab ?? 'board');
  const place = useRef<ICalendarPlace>({ pool: '', view: 'timeGridWeek', date: null, newBookingSeen: 0 });
  useEffect(() => {
    if (request) {
      setTab(request.tab);
    }
  }, [request]); // a new request (showView) is a new object
  const newBooking = request?.newBooking ? request.seq : 0;
  if (model.problem) {
    return (
      <div className="jp-GpuLease-content">
        <header className="jp-GpuLease-header">
          <h2 className="jp-GpuLease-title">GPU Leases</h2>
        </header>
        <div className="jp-GpuLease-problem" role="alert">
          {model.problem}
        </div>
      </div>
    );
  }
  const now = model.serverNow();
  const lease = model.version?.lease_server;
  return (
    <div className="jp-GpuLease-content">
      <header className="jp-GpuLease-header">
        <h2 className="jp-GpuLease-title">GPU Leases</h2>
        <span className={`jp-GpuLease-live jp-GpuLease-live-${model.live}`} role="status" aria-label="live updates">
          {LIVE_TEXT[model.live]}
        </span>
        <span className="jp-GpuLease-who">
          {model.user ? `as ${model.user}` : ''}
          {lease?.url ? ` · ${lease.url}` : ''}
        </span>
      </header>
      {model.mismatch && (
        <div role="alert" className="jp-GpuLease-warning">
          {model.mismatch}
        </div>
      )}
      {model.error && (
        <div role="alert" className="jp-GpuLease-error">
          {model.error}
          {model.updatedAt ? ` (showing the state of ${model.updatedAt.toLocaleTimeString()})` : ''}
        </div>
      )}
      <Tabs tab={tab} onTab={setTab} />
      {tab === 'board' ? (
        <div role="tabpanel" id="jp-GpuLease-tabpanel-board" aria-labelledby="jp-GpuLease-tab-board">
          <section aria-label="GPU board" className={model.error ? 'jp-GpuLease-stale' : ''}>
            <h3 className="jp-GpuLease-heading">GPU board</h3>
            <Board model={model} now={now} />
          </section>
          <div className="jp-GpuLease-columns">
            <section aria-label="My leases">
              <h3 className="jp-GpuLease-heading">My leases</h3>
              <MyLeases model={model} now={now} />
            </section>
            <section aria-label="My bookings">
              <h3 className="jp-GpuLease-heading">My bookings</h3>
              <MyBookings model={model} now={now} />
            </section>
          </div>
          <Queue model={model} now={now} />
        </div>
      ) : tab === 'calendar' ? (
        <div role="tabpanel" id="jp-GpuLease-tabpanel-calendar" aria-labelledby="jp-GpuLease-tab-calendar">
          {model.cluster ? (
            <BookingCalendar model={model} place={place.current} newBooking={newBooking} />
          ) : (
            <p className="jp-GpuLease-empty">Loading…</p>
          )}
        </div>
      ) : (
        <div role="tabpanel" id="jp-GpuLease-tabpanel-usage" aria-labelledby="jp-GpuLease-tab-usage">
          <UsagePanel model={model} />
        </div>
      )}
    </div>
  );
}

export type Tab = 'board' | 'calendar' | 'usage';
const TABS: { id: Tab; label: string }[] = [
  { id: 'board', label: 'Board' },
  { id: 'calendar', label: 'Calendar' },
  { id: 'usage', label: 'Usage' }
];

/** The three views, as ARIA tabs (arrow keys move between them). */
function Tabs(props: { tab: Tab; onTab: (tab: Tab) => void }): JSX.Element {
  const { tab, onTab } = props;
  const refs = useRef<Record<string, HTMLButtonElement | null>>({});
  return (
    <div role="tablist" aria-label="GPU Leases views" className="jp-GpuLease-tabs">
      {TABS.map((t, n) => (
        <button
          key={t.id}
          ref={el => (refs.current[t.id] = el)}
          role="tab"
          id={`jp-GpuLease-tab-${t.id}`}
          aria-selected={tab === t.id}
          aria-controls={`jp-GpuLease-tabpanel-${t.id}`}
          tabIndex={tab === t.id ? 0 : -1}
          className={`jp-GpuLease-tab${tab === t.id ? ' jp-mod-current' : ''}`}
          onClick={() => onTab(t.id)}
          onKeyDown={e => {
            if (e.key === 'ArrowRight' || e.key === 'ArrowLeft') {
              const next = TABS[(n + (e.key === 'ArrowRight' ? 1 : TABS.length - 1)) % TABS.length].id;
              onTab(next);
              refs.current[next]?.focus();
            }
          }}
        >
          {t.label}
        </button>
      ))}
    </div>
  );
}

export class GpuLeasePanel extends ReactWidget {
  constructor(readonly model: GpuLeaseModel) {
    super();
    this.addClass('jp-GpuLease-panel');
  }

  /** Show a tab (the commands "GPU Leases: Calendar", "GPU Leases: New booking…"). */
  showView(tab: Tab, newBooking = false): void {
    this._request = { tab, newBooking, seq: (this._request?.seq ?? 0) + 1 };
    this.update();
  }

  render(): JSX.Element {
    return <GpuLeaseView model={this.model} request={this._request} />;
  }

  private _request: IShowRequest | null = null;
}
