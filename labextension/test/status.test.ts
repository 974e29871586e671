// status.tsx: what the status bar item says ("GPU: 2 held · 5 free") and its tooltip, for each
// state of the model. @jupyterlab/ui-components needs a browser: its ReactWidget is stubbed.
import { ServerConnection } from '@jupyterlab/services';
import { beforeEach, describe, expect, test, vi } from 'vitest';

import { IBalance, ICluster, ILease } from '../src/api';
import { GpuLeaseModel, INSTALL_HINT } from '../src/model';
import { statusText, statusTitle } from '../src/status';

vi.mock('@jupyterlab/ui-components', () => ({ ReactWidget: class {} }));

const lease = (id: string, gpus: number, more: Partial<ILease> = {}): ILease => ({
  id,
  user: 'alice',
  pool: 'A100',
  node: 'n1',
  gpus: Array.from({ length: gpus }, (_, index) => ({ index, uuid: `GPU-${index}` })),
  state: 'active',
  label: '',
  session: 's',
  ttl: 60,
  created_at: 0,
  expires_at: 60,
  ...more
});

let model: GpuLeaseModel;
beforeEach(() => {
  model = new GpuLeaseModel({ baseUrl: 'http://localhost:8888/' } as ServerConnection.ISettings);
});

const cluster = { now: 0, nodes: [], pools: { A100: { free: 5 }, cpu: { free: 8 } }, cpu_pool: 'cpu' } as ICluster;

describe('statusText', () => {
  test('before the first answer, and when there is none', () => {
    expect(statusText(model)).toBe('GPU: …');
    model.error = 'lease server unreachable';
    expect(statusText(model)).toBe('GPU: lease server unreachable');
  });

  test('the server extension missing, or another problem', () => {
    model.problem = INSTALL_HINT;
    expect(statusText(model)).toBe('GPU: server extension missing');
    model.problem = 'gpulease: 500';
    expect(statusText(model)).toBe('GPU: unavailable');
  });

  test('GPUs held and free', () => {
    model.cluster = cluster;
    model.leases = [lease('a', 2)];
    expect(statusText(model)).toBe('GPU: 2 held · 5 free');
  });

  test('a slice and a warm GPU are counted apart from the GPUs held', () => {
    model.cluster = cluster;
    model.leases = [lease('a', 2), lease('s', 1, { gpu_mem_mb: 1024 }), lease('w', 1, { warm_since: 5 })];
    expect(statusText(model)).toBe('GPU: 2 held · 1 slice · 1 warm · 5 free');
    model.leases.push(lease('s2', 1, { gpu_mem_mb: 2048 }));
    expect(statusText(model)).toBe('GPU: 2 held · 2 slices · 1 warm · 5 free');
  });

  test('a warm slice is counted apart, and k slices of one lease count k', () => {
    model.cluster = cluster;
    model.leases = [lease('k', 2, { gpu_mem_mb: 1024 }), lease('w', 1, { gpu_mem_mb: 1024, warm_since: 5 })];
    expect(statusText(model)).toBe('GPU: 0 held · 2 slices · 1 warm slice · 5 free');
  });

  test("a sliced GPU's memory no slice holds is said beside the free count", () => {
    model.cluster = {
      ...cluster,
      pools: { A100: { free: 0, unpromised_mb: 61440 }, T4: { free: 0, unpromised_mb: 0 }, cpu: { free: 8 } }
    };
    model.leases = [lease('s', 1, { gpu_mem_mb: 20480 })];
    expect(statusText(model)).toBe('GPU: 0 held · 1 slice · 0 free · 60 GB unpromised');
    expect(statusTitle(model)).toContain('unpromised: memory of shared (sliced) GPUs that no slice holds');
    model.cluster = { ...cluster, pools: { A100: { free: 2, unpromised_mb: 0 } } };
    expect(statusText(model)).toBe('GPU: 0 held · 1 slice · 2 free');
  });

  test('a server without the pools\' unpromised_mb: the nodes shown are summed (up, GPU pools)', () => {
    const gpu = (free_mb: number) => ({ index: 0, state: 'sliced', slice_mem: { total_mb: 81920, used_mb: 0, free_mb } });
    model.cluster = {
      ...cluster,
      nodes: [
        { name: 'n1', pool: 'A100', state: 'up', gpus: [gpu(40960)] },
        { name: 'n2', pool: 'A100', state: 'down', gpus: [gpu(81920)] },
        { name: 'c1', pool: 'cpu', state: 'up', gpus: [gpu(1024)] }
      ]
    };
    expect(model.unpromisedMb).toBe(40960);
    expect(statusText(model)).toBe('GPU: 0 held · 5 free · 40 GB unpromised');
  });

  test('stale after a failed refresh', () => {
    model.cluster = cluster;
    model.error = 'lease server unreachable';
    expect(statusText(model)).toBe('GPU: 0 held · 5 free (stale)');
  });
});

describe('statusTitle', () => {
  test('the problem or the error as it is', () => {
    model.error = 'lease server http://ls:8000: refused';
    expect(statusTitle(model)).toBe('lease server http://ls:8000: refused');
  });

  test('what it counts, then my balance per GPU pool (not the CPU pool)', () => {
    model.cluster = cluster;
    const pool = (name: string, text: string): IBalance['pools'][number] => ({
      pool: name,
      quota: 4,
      held: 1,
      left: 3,
      scheduler: 'fair',
      fair_share: { rank: 1, of: 2, usage_gpu_s: 0 },
      next_wait_s: null,
      next_wait: null,
      text
    });
    model.balance = {
      user: 'alice',
      teams: [],
      pools: [pool('A100', '1 of 4 GPUs yours, 3 left'), pool('cpu', 'no quota')]
    };
    expect(statusTitle(model)).toBe(
      'GPUs you hold, and GPUs free in the cluster: open GPU Leases\nA100: 1 of 4 GPUs yours, 3 left'
    );
  });

  test('says what warm means once I have a warm GPU', () => {
    model.cluster = cluster;
    model.leases = [lease('w', 1, { warm_since: 5 })];
    expect(statusTitle(model)).toContain('kept warm for your next cell (lent out if someone waits)');
  });
});

describe('a warm GPU of mine lent out', () => {
  test('the status bar says to whom, the tooltip when and which GPU', () => {
    model.cluster = cluster;
    model.leases = [];
    const at = new Date(2026, 0, 5, 14, 2).getTime() / 1000;
    model.lent = [{ lease: 'w', to: 'bob', at, where: 'box GPU 0', mine: false }];
    expect(statusText(model)).toBe('GPU: 0 held · 5 free · warm GPU lent to bob');
    const line = statusTitle(model).split('\n').find(l => l.startsWith('your warm GPU'));
    expect(line).toMatch(/^your warm GPU \(box GPU 0\) was lent to bob at (14:02|2:02 PM): bob waited for it; /);
    model.lent.push({ lease: 'v', to: 'alice', at, where: 'box GPU 1', mine: true });
    expect(statusText(model)).toBe('GPU: 0 held · 5 free · 2 warm GPUs lent');
    model.lent = [model.lent[1]];
    expect(statusText(model)).toBe('GPU: 0 held · 5 free · warm GPU lent to your other notebook');
  });
});
