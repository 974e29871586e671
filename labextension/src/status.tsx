/**
 * The status bar item: "GPU: 2 held · 5 free" ("GPU: 0 held · 1 slice · 5 free" with a slice of a
 * GPU, "GPU: 0 held · 0 free · 60 GB unpromised" while sliced GPUs have memory no slice holds, "GPU: 0 held · 1 warm · 5 free" while a finished cell's GPU is kept warm for the notebook's
 * next cell: lendable, so not held; "· warm GPU lent to bob" the moment one is lent to someone who
 * waited, until the notebook's next cell takes GPUs again). Its tooltip adds when and which GPU, and
 * my balance per pool. Clicking it opens the GPU Leases panel.
 */
import { ReactWidget } from '@jupyterlab/ui-components';
import React, { useEffect, useReducer } from 'react';

import { clock } from './clock';
import { ILent, INSTALL_HINT, GpuLeaseModel, memSize } from './model';

export function statusText(model: GpuLeaseModel): string {
  if (model.problem) {
    return model.problem === INSTALL_HINT ? 'GPU: server extension missing' : 'GPU: unavailable';
  }
  if (!model.cluster) {
    return model.error ? 'GPU: lease server unreachable' : 'GPU: …';
  }
  const stale = model.error ? ' (stale)' : '';
  // A slice is part of one GPU: counted as slices, never as GPUs held.
  const slices = model.heldSlices;
  const sliced = slices ? ` · ${slices} slice${slices === 1 ? '' : 's'}` : '';
  // A warm GPU is the notebook's for its next cell, but lent to anyone who waits: counted apart.
  const warm = model.warmGpus ? ` · ${model.warmGpus} warm` : '';
  const ws = model.warmSlices;
  const warmSliced = ws ? ` · ${ws} warm slice${ws === 1 ? '' : 's'}` : '';
  // Memory of sliced GPUs no slice holds: a --gpu-mem cell fits there even with no GPU free.
  const room = model.unpromisedMb;
  const unpromised = room > 0 ? ` · ${memSize(room)} unpromised` : '';
  // The moment a warm GPU of mine is lent out: to whom (the tooltip says when, and which GPU).
  const lent = model.lent;
  const lentTo =
    lent.length === 1
      ? ` · warm GPU lent to ${lentWho(lent[0])}`
      : lent.length > 1
        ? ` · ${lent.length} warm GPUs lent`
        : '';
  return `GPU: ${model.heldGpus} held${sliced}${warm}${warmSliced} · ${model.freeGpus} free${unpromised}${lentTo}${stale}`;
}

function lentWho(lent: ILent): string {
  return lent.mine ? 'your other notebook' : lent.to;
}

/** "your warm GPU (box GPU 0) was lent to bob at 14:02: bob waited for it; your next cell asks for it again" */
export function lentLine(lent: ILent): string {
  const when = clock(new Date(lent.at * 1000));
  const waited = lent.mine ? 'another notebook of yours waited for it' : `${lent.to} waited for it`;
  return `your warm GPU (${lent.where}) was lent to ${lentWho(lent)} at ${when}: ${waited}; your next GPU cell asks for it again`;
}

/** The tooltip: what the item counts, then my balance, a line per pool ("A100-80GB: 1 of 4 GPUs yours, 3 left; ..."). */
export function statusTitle(model: GpuLeaseModel): string {
  if (model.problem || model.error) {
    return (model.problem ?? model.error) as string;
  }
  const lines = [
    model.warmGpus || model.warmSlices
      ? 'GPUs you hold, yours kept warm for your next cell (lent out if someone waits), and GPUs free: open GPU Leases'
      : 'GPUs you hold, and GPUs free in the cluster: open GPU Leases'
  ];
  if (model.unpromisedMb > 0) {
    lines.push('unpromised: memory of shared (sliced) GPUs that no slice holds: room for a --gpu-mem cell');
  }
  for (const lent of model.lent) {
    lines.push(lentLine(lent));
  }
  const cpu = model.cluster?.cpu_pool;
  for (const p of model.balance?.pools ?? []) {
    if (p.pool !== cpu) {
      lines.push(`${p.pool}: ${p.text}`);
    }
  }
  return lines.join('\n');
}

function StatusView(props: { model: GpuLeaseModel; onClick: () => void }): JSX.Element {
  const { model, onClick } = props;
  const [, bump] = useReducer((n: number) => n + 1, 0);
  useEffect(() => {
    const onChange = () => bump();
    model.changed.connect(onChange);
    return () => {
      model.changed.disconnect(onChange);
    };
  }, [model]);
  const text = statusText(model);
  const title = statusTitle(model);
  return (
    <button className="jp-GpuLease-status" title={title} aria-label={`${text}: open GPU Leases`} onClick={onClick}>
      {text}
    </button>
  );
}

export class GpuLeaseStatus extends ReactWidget {
  constructor(
    readonly model: GpuLeaseModel,
    private readonly _open: () => void
  ) {
    super();
    this.addClass('jp-GpuLease-statusItem');
  }

  render(): JSX.Element {
    return <StatusView model={this.model} onClick={this._open} />;
  }
}
