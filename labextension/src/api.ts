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
}

export interface IGpu {
  index: number;
  uuid?: string;
  model?: string;
  memory_mb?: number;
  /** free | leased | down today; reserved | borrowed | idle once the server has them. */
  state: string;
  lease?: IHolder;
  /** The node agent's newest utilization sample. */
  sample?: { at: number; util: number; mem_used_mb: number };
  /** Processes on a GPU that no lease covers. */
  unleased_use?: Record<string, unknown>;
}

export interface INode {
  name: string;
  pool: string;
  state: string; // up | down
  gpus: IGpu[];
}

export interface ICluster {
  now: number; // the lease server's clock, epoch seconds
  nodes: INode[];
  pools: Record<string, Record<string, number>>;
  default_pool?: string | null;
}

export interface ILease {
  id: string;
  user: string;
  pool: string;
  node: string;
  gpus: { index: number; uuid: string }[];
  state: string;
  label: string;
  session: string;
  ttl: number;
  created_at: number;
  expires_at: number;
  idle_warning?: boolean;
  reclaim_at?: number;
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
    message: string
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
  let data: any = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!response.ok) {
    const code = data?.code ?? 'http_error';
    const message = data?.message ?? `HTTP ${response.status} ${response.statusText} from ${url}`;
    throw new GpuLeaseError(response.status, code, message);
  }
  if (data === null) {
    throw new GpuLeaseError(response.status, 'bad_answer', `${url} did not answer with JSON`);
  }
  return data as T;
}
