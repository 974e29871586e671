// panel.tsx: what the GPU board says of a GPU in each state (the tile's accessible name, the state
// it is drawn in), of a slice, and of a recalled lease. JupyterLab's widgets need a browser: they
// are stubbed (the functions tested are plain).
import { ServerConnection } from '@jupyterlab/services';
import { beforeEach, describe, expect, test, vi } from 'vitest';

import { IGpu, IHolder, INode, ISlice } from '../src/api';
import { GpuLeaseModel } from '../src/model';
import { STATES, gpuTileText, holderOrigin, overMemory, recallCountdown, sliceText } from '../src/panel';

vi.mock('@jupyterlab/ui-components', () => ({ ReactWidget: class {} }));
vi.mock('@jupyterlab/apputils', () => ({ Dialog: {}, showDialog: vi.fn() }));

const NOW = 10_000;
const node: INode = { name: 'n1', pool: 'A100', state: 'up', gpus: [] };
const holder = (more: Partial<IHolder> = {}): IHolder => ({
  id: 'L1',
  user: 'bob',
  label: '',
  since: NOW - 125,
  expires_at: NOW + 600,
  ...more
});
const gpu = (more: Partial<IGpu>): IGpu => ({ index: 0, model: 'A100-80GB', state: 'free', ...more });

let model: GpuLeaseModel;
beforeEach(() => {
  model = new GpuLeaseModel({ baseUrl: 'http://localhost:8888/' } as ServerConnection.ISettings);
  model.user = 'alice';
});

describe('a GPU tile', () => {
  test('free', () => {
    const t = gpuTileText(model, node, gpu({ state: 'free', sample: { at: NOW, util: 3.4, mem_used_mb: 0 } }), NOW);
    expect(t.state).toBe('free');
    expect(t.name).toBe('n1 GPU 0: free');
    expect(t.title).toBe('A100-80GB · 3% busy');
  });

  test("leased: by whom, how long, mine or not", () => {
    const theirs = gpuTileText(model, node, gpu({ state: 'leased', lease: holder({ label: 'train' }) }), NOW);
    expect(theirs.name).toBe('n1 GPU 0: leased, by bob, held 2m05s, label train');
    expect(theirs.mine).toBe(false);
    expect(theirs.title).toBe('L1 · train · expires in 10m00s unless renewed');
    const mine = gpuTileText(model, node, gpu({ state: 'leased', lease: holder({ user: 'alice' }) }), NOW);
    expect(mine.name).toBe('n1 GPU 0: leased, by alice (you), held 2m05s');
    expect(mine.mine).toBe(true);
  });

  test('idle-warned: drawn idle, with its countdown', () => {
    const t = gpuTileText(
      model,
      node,
      gpu({ state: 'leased', lease: holder({ idle_warning: true, reclaim_at: NOW + 27 }) }),
      NOW
    );
    expect(t.state).toBe('idle');
    expect(t.idle).toBe(true);
    expect(t.name).toBe('n1 GPU 0: leased, by bob, held 2m05s, idle — reclaimed in 27 s');
  });

  test('warm: lendable, and how long it has been kept', () => {
    const t = gpuTileText(model, node, gpu({ state: 'warm', lease: holder({ warm_since: NOW - 120 }) }), NOW);
    expect(t.state).toBe('warm');
    expect(t.name).toBe('n1 GPU 0: warm · lendable, by bob, held 2m05s, kept warm 2m00s, lent out if someone waits');
  });

  test('warm and evicted for a waiting request', () => {
    const t = gpuTileText(
      model,
      node,
      gpu({ state: 'warm', lease: holder({ warm_since: NOW - 120, recall_at: NOW + 20 }) }),
      NOW
    );
    expect(t.name).toBe('n1 GPU 0: warm · lendable, by bob, held 2m05s, evicted for a waiting request — free in 20 s');
  });

  test('borrowed and recalled, or preempted', () => {
    const borrowed = gpuTileText(
      model,
      node,
      gpu({ state: 'borrowed', lease: holder({ borrowed: true, recall_at: NOW + 90 }) }),
      NOW
    );
    expect(borrowed.name).toBe('n1 GPU 0: borrowed, by bob, held 2m05s, recalled — revoked in 1m30s');
    const preempted = gpuTileText(model, node, gpu({ state: 'leased', lease: holder({ recall_at: NOW + 5 }) }), NOW);
    expect(preempted.name).toContain('preempted — revoked in 5 s');
  });

  test('reserved for a booking: whose, and mine when it is', () => {
    const t = gpuTileText(model, node, gpu({ state: 'reserved', reservation: { id: 'r-1', owner: 'alice' } }), NOW);
    expect(t.name).toBe('n1 GPU 0: reserved, for alice (you)');
    expect(t.bookingMine).toBe(true);
    const team = gpuTileText(model, node, gpu({ state: 'reserved', reservation: { id: 'r-2', owner: 'team:x' } }), NOW);
    expect(team.name).toBe('n1 GPU 0: reserved, for team:x');
  });

  test('draining: whose lease ended, an unleased process, or a process given up', () => {
    const ended = gpuTileText(
      model,
      node,
      gpu({ state: 'draining', draining: { lease: 'L0', user: 'carol', state: 'revoked', since: NOW - 5 } }),
      NOW
    );
    expect(ended.state).toBe('draining');
    expect(ended.name).toBe("n1 GPU 0: draining, carol's lease revoked: free once its processes are gone");
    const unleased = gpuTileText(
      model,
      node,
      gpu({ state: 'draining', draining: { lease: '', user: '', state: 'unleased', since: NOW } }),
      NOW
    );
    expect(unleased.name).toBe('n1 GPU 0: draining, held out of the pool: a process no lease covers uses it');
    const abandoned = gpuTileText(
      model,
      node,
      gpu({
        state: 'draining',
        draining: { lease: 'L0', user: 'carol', state: 'revoked', since: NOW, abandoned: { pid: 4242, why: 'stuck' } }
      }),
      NOW
    );
    expect(abandoned.name).toBe(
      'n1 GPU 0: draining, its agent gave up pid 4242: an admin checks it (gpulease drain list)'
    );
  });

  test('used without a lease', () => {
    const t = gpuTileText(model, node, gpu({ state: 'free', unleased_use: { pids: [1] } }), NOW);
    expect(t.name).toBe('n1 GPU 0: free, in use without a lease');
  });
});

test('the legend names warm and sliced GPUs as lendable and shared', () => {
  expect(STATES.warm.label).toBe('warm · lendable');
  expect(STATES.sliced.label).toBe('sliced · shared');
  expect(STATES.idle.legend).toBe(false); // shown in the legend only when a GPU is idle
  expect(STATES.over).toEqual({ label: 'slice over its memory', legend: false });
});

describe('a slice', () => {
  const slice: ISlice = { lease: 'S1', user: 'bob', label: 'eval', gpu_mem_mb: 10240, since: NOW - 60, expires_at: NOW + 60 };

  test('before its node agent measured it', () => {
    expect(sliceText(slice, 81920, false, NOW)).toEqual({
      head: 'bob · 10 GB of 80 GB',
      used: '',
      name: 'bob, 10 GB of 80 GB, held 1m00s, label eval',
      state: 'leased'
    });
  });

  test('measured: what it uses and its peak; mine', () => {
    const t = sliceText({ ...slice, mem_used_mb: 3072, mem_peak_mb: 3994 }, 81920, true, NOW);
    expect(t.head).toBe('bob (you) · 10 GB of 80 GB');
    expect(t.used).toBe('using 3 GB, peak 3.9 GB');
    expect(t.name).toBe('bob (you), 10 GB of 80 GB, using 3 GB, peak 3.9 GB, held 1m00s, label eval');
  });

  test('warm: lendable, and said so; then taken back', () => {
    const warm = sliceText({ ...slice, warm_since: NOW - 5 }, 81920, false, NOW);
    expect(warm.head).toBe('bob · 10 GB of 80 GB · warm');
    expect(warm.name).toBe('bob, 10 GB of 80 GB, kept warm 5s, lent out if someone waits, held 1m00s, label eval');
    const evicted = sliceText({ ...slice, warm_since: NOW - 5, recall_at: NOW + 2 }, 81920, false, NOW);
    expect(evicted.head).toBe('bob · 10 GB of 80 GB · taken back in 2s');
    expect(warm.state).toBe('warm');
  });

  test('over its memory: drawn over, and named on its line and in its name', () => {
    const at = sliceText({ ...slice, mem_used_mb: 10240, mem_peak_mb: 10240 }, 81920, false, NOW);
    expect(at.state).toBe('leased'); // all it was promised is not over
    const over = sliceText({ ...slice, mem_used_mb: 12288, mem_peak_mb: 13312 }, 81920, false, NOW);
    expect(over.state).toBe('over');
    expect(over.head).toBe('bob · 10 GB of 80 GB · over its memory');
    expect(over.used).toBe('using 12 GB, peak 13 GB');
    expect(over.name).toBe(
      'bob, 10 GB of 80 GB, using 12 GB, peak 13 GB, over its memory: ended if it stays over, held 1m00s, label eval'
    );
    const warmOver = sliceText({ ...slice, mem_used_mb: 12288, warm_since: NOW - 5 }, 81920, false, NOW);
    expect(warmOver.head).toBe('bob · 10 GB of 80 GB · warm · over its memory');
    expect(overMemory({ ...slice })).toBe(false); // not measured: not over
  });
});

test('recallCountdown: recalled (borrowed) or preempted', () => {
  expect(recallCountdown(NOW + 27, NOW, true)).toBe('recalled — revoked in 27 s');
  expect(recallCountdown(NOW + 27, NOW, false)).toBe('preempted — revoked in 27 s');
  expect(recallCountdown(NOW, NOW + 1, true)).toBe('recalled — revoked now');
});

describe('holderOrigin', () => {
  test('a notebook and a numbered cell', () => {
    expect(holderOrigin(holder({ notebook: 'work/train.ipynb', cell: '4', label: 'fit()' }), undefined)).toEqual({
      text: 'train.ipynb · cell 4',
      title: 'fit()'
    });
  });

  test("a cell's hash goes to the tooltip; no notebook: the label", () => {
    expect(holderOrigin(holder({ notebook: 'train.ipynb', cell: 'a1b2' }), undefined)).toEqual({
      text: 'train.ipynb',
      title: 'cell a1b2'
    });
    expect(holderOrigin(holder({ label: 'fit()' }), undefined)).toEqual({ text: 'fit()', title: 'fit()' });
    expect(holderOrigin(holder(), undefined)).toBeNull();
  });
});
