/**
 * The /gpulease/ API of the server extension (jupyter_ext): types and one request function.
 *
 * Errors come back as JSON {code, message}; requestAPI turns them into GpuLeaseError so the UI
 * can show the message as it is (it says what to fix).
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** The lease holding a GPU, as GET /gpulease/cluster shows it. */
export interface IHolder {
  id: string;
  user: string;
  label: string;
  since: number; // epoch seconds, lease server clock
  expires_at: number;
  /** Idle reclaim warned this lease: it is revoked at reclaim_at unless its GPUs get busy or it is kept. */
  idle_warning?: boolean;
  reclaim_at?: number;
  /** Leased from capacity a booking holds back: revoked (at recall_at) once the booking's holder asks. */
  borrowed?: boolean;
  /** Kept warm since (epoch s): its worker stays for the notebook's next cell; lent out if someone waits. */
  warm_since?: number;
  /** Recalled (borrowed and its booking's holder asked, or preempted for quota): revoked at recall_at. */
  recall_at?: number;
  /** Where the lease comes from, when the client said (%%gpu_train sends them): a notebook's path, its cell. */
  notebook?: string;
  cell?: string;
  /** What its processes use of the GPU's memory now and at their peak (MB), as its node agent measured them. */
  mem_used_mb?: number;
  mem_peak_mb?: number;
}

/** A slice of a GPU: a lease of part of its memory (docs/slices.md). */
export interface ISlice {
  lease: string;
  user: string;
  label: string;
  gpu_mem_mb: number;
  since: number;
  expires_at: number;
  /** What its processes use now and at their peak (MB), once its node agent measured them. */
  mem_used_mb?: number;
  mem_peak_mb?: number;
  /** Kept warm since (epoch s): its worker waits for its notebook's next cell; lent out if someone waits. */
  warm_since?: number;
  /** Being evicted (warm, for someone who waits) or recalled for a booking: revoked at recall_at. */
  recall_at?: number;
}

export interface IGpu {
  index: number;
  uuid?: string;
  model?: string;
  memory_mb?: number;
  /** free | leased | warm (kept for its notebook's next cell; lendable) | reserved (free, held back for a booking now) | borrowed | draining | sliced (shared by slices) | down. */
  state: string;
  lease?: IHolder;
  /** The booking a reserved GPU is held back for. */
  reservation?: { id: string; owner: string };
  /** The node agent's newest utilization sample. */
  sample?: { at: number; util: number; mem_used_mb: number };
  /** The server ended this GPU's lease: free once its node agent sees that lease's processes gone. */
  draining?: {
    lease: string;
    user: string;
    state: string;
    since: number;
    /** its node agent gave a process up (drain_abandoned): out of service until an admin clears it */
    abandoned?: { pid: number; why: string };
  };
  /** Processes on a GPU that no lease covers. */
  unleased_use?: Record<string, unknown>;
  /** A sliced GPU: its live slices (largest first), those still draining, and its memory (MB). */
  slices?: ISlice[];
  slices_draining?: { lease: string; user: string; gpu_mem_mb: number; since: number }[];
  slice_mem?: { total_mb: number; used_mb: number; free_mb: number };
}

export interface INode {
  name: string;
  pool: string;
  /** Where its GPUs come from: nvml (real ones), simulated (gpulease up --simulate: nothing runs on them). */
  source?: string;
  state: string; // up | down
  gpus: IGpu[];
  /** Evicted warm workers whose GPU state waits in host memory for their notebook's next cell. */
  suspended?: { user: string; lease: string; bytes: number; since: number; until?: number }[];
}

export interface ICluster {
  now: number; // the lease server's clock, epoch seconds
  /** The nodes asked for: a page of them (GET /cluster?pool=&limit=), in name order. */
  nodes: INode[];
  /** How many nodes the pool asked for has (every pool: all nodes); more than `nodes` on a page. */
  nodes_total?: number;
  /** The name to ask `after` for the next page; null on the last. */
  next?: string | null;
  /** Every pool's counts, whatever page of the nodes came. */
  pools: Record<string, Record<string, number>>;
  default_pool?: string | null;
  /** The pool of CPU slots (%%gpu_train --gpus 0), if one is registered: not counted as GPUs. */
  cpu_pool?: string | null;
}

/** A lease's state (lease_server.protocol.LeaseState; tests/test_protocol.py keeps them equal). */
export type LeaseState = 'active' | 'released' | 'expired' | 'revoked';

export interface ILease {
  id: string;
  user: string;
  pool: string;
  node: string;
  gpus: { index: number; uuid: string }[];
  state: LeaseState;
  label: string;
  session: string;
  ttl: number;
  created_at: number;
  expires_at: number;
  idle_warning?: boolean;
  reclaim_at?: number;
  borrowed?: boolean;
  recall_at?: number;
  /** The notebook (its path) and cell the lease was taken for, if the client said. */
  notebook?: string;
  cell?: string;
  /** A slice: the memory it holds of its GPU, and the GPU's memory (MB). */
  gpu_mem_mb?: number;
  gpu_total_mb?: number;
  /** Kept warm since (epoch s): its cell ended, its worker waits for the notebook's next cell; lent out if someone waits. */
  warm_since?: number;
  /** Being recalled (or, ended, it was): why, whose request its GPUs went to, and since when (epoch s). */
  recall_cause?: { code: string; by: string; why: string };
  recall_for?: string;
  recalled_at?: number;
}

/**
 * The figures of one row of GET /gpulease/usage/summary (the lease server's UsageFigures): GPU
 * figures in GPU-seconds, waits in milliseconds; null where a figure cannot be computed (nothing
 * sampled, no calls, no cells). docs/usage.md says what each one is.
 */
export interface IUsageFigures {
  calls: number;
  cells: number;
  warm_cells: number;
  warm_cell_share: number | null;
  held_gpu_s: number;
  sampled_gpu_s: number;
  used_gpu_s: number;
  util_pct: number | null;
  warm_gpu_s: number;
  reclaimed_gpu_s: number;
  evicted_gpu_s: number;
  waits: number;
  wait_ms_sum: number;
  wait_mean_ms: number | null;
  wait_p50_ms: number | null;
  wait_p95_ms: number | null;
}

export interface IUsageDay extends IUsageFigures {
  day: string; // a UTC day, 2026-11-27
}

/** GET /gpulease/usage/summary: per-day series and totals, overall and per user, team or pool. */
export interface IUsageSummary {
  from: number; // epoch seconds, widened to whole hours
  to: number;
  by: 'user' | 'team' | 'pool';
  pool: string | null;
  user: string | null;
  /** "own": this server shows a user only their own rows (usage_own_rows_only). */
  scope: 'all' | 'own';
  days: string[];
  total: IUsageFigures;
  daily: IUsageDay[];
  /** Largest first (GPU-seconds held + warm). */
  groups: { key: string; total: IUsageFigures; daily: IUsageDay[] }[];
  /** With also_by: the same rows grouped a second way. */
  also?: { by: 'user' | 'team' | 'pool'; groups: IUsageSummary['groups'] };
}

/** GET /gpulease/usage/balance: the lease user's quota left, fair-share place and next wait, per pool. */
export interface IBalance {
  user: string;
  teams: string[];
  pools: {
    pool: string;
    quota: number | null;
    held: number;
    left: number | null;
    scheduler: string;
    fair_share: { rank: number; of: number; usage_gpu_s: number };
    next_wait_s: number | null;
    next_wait: string | null;
    /** All of it in a short line, without the pool's name. */
    text: string;
  }[];
}

export interface IWaiter {
  id: string;
  user: string;
  pool: string;
  gpus: number;
  position: number;
  label: string;
  enqueued_at: number;
}

/** One occurrence of a booking (a weekly booking has several). Times: epoch seconds, UTC. */
export interface IInstance {
  k: number;
  start: number;
  end: number;
  state: 'upcoming' | 'active' | 'released' | 'past' | string;
  used: boolean;
}

/** A booking of GPUs of a pool, as GET /gpulease/bookings lists it. */
export interface IBooking {
  id: string;
  owner: string; // a user, or "team:NAME"
  pool: string;
  gpus: number;
  start: number; // the first occurrence
  end: number;
  repeat: 'none' | 'weekly' | string;
  occurrences: number;
  colocate: boolean;
  node: string;
  note: string;
  created_by: string;
  created_at: number;
  state: 'active' | 'cancelled' | string;
  /** The Jupyter server's lease user may change or cancel it. */
  mine: boolean;
  /** The occurrences that overlap the window asked for. */
  instances: IInstance[];
}

/** What POST /gpulease/bookings takes (PATCH: any subset). Times: epoch seconds. */
export interface IBookingRequest {
  pool: string;
  gpus: number;
  start: number;
  end: number;
  owner?: string;
  note?: string;
  repeat?: 'none' | 'weekly';
  occurrences?: number;
  colocate?: boolean;
}

/** The details of a 409 reservation_clash: who is in the way, and what would fit instead. */
export interface IClash {
  clashes: { id: string; owner: string; gpus: number; start: number; end: number }[];
  capacity: number;
  reserved: number;
  max_gpus: number;
  suggestions: { start: number; end: number }[];
}

export interface IVersion {
  version: string;
  lease_server: {
    url: string | null;
    reachable: boolean;
    version?: string;
    user?: string;
    role?: string;
    code?: string;
    error?: string;
  };
}

/** An answer of the server extension that was not 2xx (or no answer at all: status 0). */
export class GpuLeaseError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
    /** The error's details, e.g. the clash of a 409 reservation_clash. */
    readonly details: unknown = null
  ) {
    super(message);
  }
}

export function serverSettings(): ServerConnection.ISettings {
  return ServerConnection.makeSettings();
}

export function apiUrl(settings: ServerConnection.ISettings, ...parts: string[]): string {
  return URLExt.join(settings.baseUrl, 'gpulease', ...parts);
}

/** Call the server extension; JSON in the answer, GpuLeaseError for anything else. */
export async function requestAPI<T>(
  path: string,
  init: RequestInit = {},
  settings: ServerConnection.ISettings = serverSettings()
): Promise<T> {
  const url = apiUrl(settings, ...path.split('/'));
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new GpuLeaseError(0, 'network', `cannot reach the Jupyter server: ${String(error)}`);
  }
  const text = await response.text();
  let data: unknown = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!response.ok) {
    const body = data as { code?: string; message?: string; details?: unknown } | null;
    const code = body?.code ?? 'http_error';
    const message = body?.message ?? `HTTP ${response.status} ${response.statusText} from ${url}`;
    throw new GpuLeaseError(response.status, code, message, body?.details ?? null);
  }
  if (data === null) {
    throw new GpuLeaseError(response.status, 'bad_answer', `${url} did not answer with JSON`);
  }
  return data as T;
}
