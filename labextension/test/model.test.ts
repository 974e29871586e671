// model.ts: the helpers the panel writes with, and what the model counts (GPUs held, warm, slices,
// free; my bookings) from the lease server's answers.
import { ServerConnection } from '@jupyterlab/services';
import { afterEach, beforeEach, describe as group, expect, test, vi } from 'vitest';

import { GpuLeaseError, IBooking, ICluster, ILease } from '../src/api';
import {
  GpuLeaseModel,
  LENT_SHOWN_S,
  describe,
  duration,
  memSize,
  nextInstanceStart,
  reclaimCountdown
} from '../src/model';

group('duration', () => {
  test('seconds, minutes, hours, days: the two largest units', () => {
    expect(duration(42)).toBe('42s');
    expect(duration(59.9)).toBe('59s');
    expect(duration(60)).toBe('1m00s');
    expect(duration(185)).toBe('3m05s');
    expect(duration(2 * 3600 + 7 * 60 + 59)).toBe('2h07m');
    expect(duration(3 * 86400 + 4 * 3600 + 59 * 60)).toBe('3d04h');
  });

  test('never negative (a clock a little ahead)', () => {
    expect(duration(-5)).toBe('0s');
  });
});

test('memSize: GB of 1024 MB, one decimal where it has one', () => {
  expect(memSize(10240)).toBe('10 GB');
  expect(memSize(1536)).toBe('1.5 GB');
  expect(memSize(1024)).toBe('1 GB');
  expect(memSize(512)).toBe('512 MB');
  expect(memSize(99.6)).toBe('100 MB');
});

test('reclaimCountdown: seconds under a minute, then a duration, then now', () => {
  expect(reclaimCountdown(100, 73)).toBe('idle — reclaimed in 27 s');
  expect(reclaimCountdown(200, 95)).toBe('idle — reclaimed in 1m45s');
  expect(reclaimCountdown(100, 100)).toBe('idle — reclaimed now');
  expect(reclaimCountdown(100, 130)).toBe('idle — reclaimed now');
});

test('describe: the message of an error, or the thing in words', () => {
  expect(describe(new GpuLeaseError(409, 'reservation_clash', 'over-booked'))).toBe('over-booked');
  expect(describe(new TypeError('failed to fetch'))).toBe('failed to fetch');
  expect(describe('offline')).toBe('offline');
  expect(describe(404)).toBe('404');
});

const booking = (id: string, instances: [number, number, string][], more: Partial<IBooking> = {}): IBooking => ({
  id,
  owner: 'alice',
  pool: 'A100',
  gpus: 1,
  start: instances[0][0],
  end: instances[0][1],
  repeat: instances.length > 1 ? 'weekly' : 'none',
  occurrences: instances.length,
  colocate: false,
  node: '',
  note: '',
  created_by: 'alice',
  created_at: 0,
  state: 'active',
  mine: true,
  instances: instances.map(([start, end, state], k) => ({ k, start, end, state, used: false })),
  ...more
});

test('nextInstanceStart: the current or next occurrence that is not released', () => {
  const weekly = booking('r', [
    [100, 200, 'past'],
    [1000, 1100, 'released'],
    [2000, 2100, 'upcoming']
  ]);
  expect(nextInstanceStart(weekly, 150)).toBe(100);
  expect(nextInstanceStart(weekly, 500)).toBe(2000);
  expect(nextInstanceStart(weekly, 5000)).toBe(100); // all over: the first
});

const lease = (id: string, gpus: number, more: Partial<ILease> = {}): ILease => ({
  id,
  user: 'alice',
  pool: 'A100',
  node: 'n1',
  gpus: Array.from({ length: gpus }, (_, index) => ({ index, uuid: `GPU-${id}-${index}` })),
  state: 'active',
  label: '',
  session: 's',
  ttl: 60,
  created_at: 0,
  expires_at: 60,
  ...more
});

group('GpuLeaseModel counts', () => {
  let model: GpuLeaseModel;
  beforeEach(() => {
    model = new GpuLeaseModel({ baseUrl: 'http://localhost:8888/' } as ServerConnection.ISettings);
    model.cluster = {
      now: 0,
      nodes: [],
      pools: { A100: { gpus: 8, free: 3 }, H100: { gpus: 4, free: 2 }, cpu: { gpus: 16, free: 16 } },
      cpu_pool: 'cpu'
    } as ICluster;
  });
  afterEach(() => {
    vi.useRealTimers();
  });

  test('whole GPUs held, warm ones apart, slices apart, CPU slots not at all', () => {
    model.leases = [
      lease('held', 2),
      lease('warm', 1, { warm_since: 10 }),
      lease('slice', 1, { gpu_mem_mb: 10240, gpu_total_mb: 81920 }),
      lease('cpu', 1, { pool: 'cpu' })
    ];
    expect(model.heldGpus).toBe(2);
    expect(model.warmGpus).toBe(1);
    expect(model.heldSlices).toBe(1);
  });

  test('free GPUs: every pool but the CPU pool', () => {
    expect(model.freeGpus).toBe(5);
    model.cluster = null;
    expect(model.freeGpus).toBe(0);
  });

  test("my bookings: mine, active, not over; the soonest occurrence first", () => {
    vi.useFakeTimers();
    vi.setSystemTime(10_000 * 1000);
    model.bookings = [
      booking('later', [[50_000, 51_000, 'upcoming']]),
      booking('now', [[9_000, 11_000, 'active']]),
      booking('over', [[1_000, 2_000, 'past']]),
      booking('theirs', [[20_000, 21_000, 'upcoming']], { mine: false }),
      booking('cancelled', [[20_000, 21_000, 'upcoming']], { state: 'cancelled' }),
      booking('released', [[9_000, 11_000, 'released']]),
      booking('weekly', [
        [3_000, 4_000, 'past'],
        [30_000, 31_000, 'upcoming']
      ])
    ];
    expect(model.myBookings.map(r => r.id)).toEqual(['now', 'weekly', 'later']);
  });
});

group('a warm GPU of mine lent out', () => {
  const evicted = { code: 'evicted', by: 'server', why: "evicted for bob's request" };
  /** A model whose fetch answers GET leases/<id> with `ended` (and counts what was asked). */
  function modelAnswering(ended: Record<string, ILease>) {
    const asked: string[] = [];
    const fetch = vi.fn(async (url: RequestInfo | URL) => {
      const path = (url instanceof Request ? url.url : String(url)).split('?')[0]; // (a cache-busting query)
      asked.push(path);
      const id = decodeURIComponent(path.split('/gpulease/leases/')[1] ?? '');
      if (ended[id]) {
        return new Response(JSON.stringify(ended[id]), { status: 200 });
      }
      return new Response('{"code": "not_found", "message": "no such lease"}', { status: 404 });
    });
    const settings = ServerConnection.makeSettings({ baseUrl: 'http://localhost:8888/', fetch });
    const model = new GpuLeaseModel(settings);
    vi.spyOn(model, 'serverNow').mockReturnValue(1_000);
    return { model, asked };
  }

  test('a warm lease being evicted says to whom at once, without asking the server', async () => {
    const { model, asked } = modelAnswering({});
    const warm = lease('w', 1, { warm_since: 900, node: 'box' });
    const going = { ...warm, recall_at: 992, recall_cause: evicted, recall_for: 'bob', recalled_at: 990 };
    model.leases = [going];
    await model.noteLent([warm], [going]);
    expect(model.lent).toEqual([{ lease: 'w', to: 'bob', at: 990, where: 'box GPU 0', mine: false }]);
    expect(asked).toEqual([]);
  });

  test('a warm lease gone between two refreshes is read once: evicted, it says to whom; released, nothing', async () => {
    const ended = { ...lease('w', 1, { node: 'box' }), state: 'released', recall_for: 'bob', recalled_at: 990 };
    const { model, asked } = modelAnswering({
      w: { ...ended, recall_cause: evicted } as ILease,
      x: { ...lease('x', 1), state: 'released' } as ILease
    });
    const before = [lease('w', 1, { warm_since: 900 }), lease('x', 1, { warm_since: 900 }), lease('held', 1)];
    model.leases = [];
    await model.noteLent(before, []);
    expect(model.lent.map(l => [l.lease, l.to, l.where])).toEqual([['w', 'bob', 'box GPU 0']]);
    expect(asked.map(u => u.split('/gpulease/')[1])).toEqual(['leases/w', 'leases/x']); // not the held one
    await model.noteLent(before, []); // known already: not asked again
    expect(asked).toHaveLength(3); // (x only: it said nothing)
  });

  test("it stays until a lease of mine granted after it (the notebook's next cell), at most LENT_SHOWN_S", async () => {
    const { model } = modelAnswering({});
    const going = lease('w', 1, { recall_cause: evicted, recall_for: 'alice', recalled_at: 990, created_at: 100 });
    model.leases = [going];
    await model.noteLent([], [going]);
    expect(model.lent[0].mine).toBe(true); // lent to another notebook of mine
    model.leases = [lease('older', 1, { created_at: 500 })];
    await model.noteLent([], model.leases);
    expect(model.lent).toHaveLength(1);
    model.leases = [lease('next', 1, { created_at: 995 })];
    await model.noteLent([], model.leases);
    expect(model.lent).toEqual([]);
    model.leases = [going];
    vi.spyOn(model, 'serverNow').mockReturnValue(990 + LENT_SHOWN_S);
    await model.noteLent([], [going]);
    expect(model.lent).toEqual([]);
  });
});
