/**
 * The status bar item: "GPU: 2 held · 5 free" ("GPU: 0 held · 1 slice · 5 free" with a slice of a
 * GPU). Clicking it opens the GPU Leases panel.
 */
import { ReactWidget } from '@jupyterlab/ui-components';
import React, { useEffect, useReducer } from 'react';

import { INSTALL_HINT, GpuLeaseModel } from './model';

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
  return `GPU: ${model.heldGpus} held${sliced} · ${model.freeGpus} free${stale}`;
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
  const title = model.problem ?? model.error ?? 'GPUs you hold, and GPUs free in the cluster: open GPU Leases';
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
