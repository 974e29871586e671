/**
 * The state behind the panel and the status bar item: the cluster, my leases, the queue and the
 * bookings, kept current by the lease server's event stream (GET /gpulease/events, an EventSource).
 * Calendars listen to bookingsChanged and refetch the window they show.
 *
 * Each relevant event schedules one refetch (coalesced over a short delay, so a burst of grants
 * costs one round of requests). If the stream breaks, the model says so, reconnects with backoff,
 * and refetches everything on reconnect: what it shows is either live or marked as stale.
 */
import { ServerConnection } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import {
  GpuLeaseError,
  IBalance,
  IBooking,
  IBookingRequest,
  ICluster,
  IUsageSummary,
  ILease,
  IVersion,
  IWaiter,
  apiUrl,
  requestAPI,
  serverSettings
} from './api';

declare function require(path: '../package.json'): { version: string };
/** This front end's version; the server extension's must match (the handshake). */
export const VERSION: string = require('../package.json').version;

export const INSTALL_HINT =
  'server extension missing: run pip install gpulease and restart JupyterLab';

/**
 * Event types after which the board may have changed (with BOOKING_EVENTS: bookings make GPUs
 * reserved). New GPU states come with new event types: add them here and to
 * lease_server/protocol.py's BOARD_EVENTS (tests/test_protocol.py keeps the two lists equal).
 */
export const BOARD_EVENTS = [
  'grant',
  'released',
  'expired',
  'revoked',
  'queued',
  'wait_timeout',
  'wait_cancelled',
  'wait_abandoned',
  'node_registered',
  'node_up',
  'node_down',
  'idle_warning',
  'idle_cleared',
  'idle_kept',
  'reclaimed',
  'unleased_use',
  'unleased_use_ended',
  'preempt_notice',
  'borrow_recalled',
  'grown',
  'shrunk',
  'shrink_notice',
  'drained',
  'drain_abandoned',
  'unleased_held',
  'warm',
  'resumed',
  'evicting',
  'suspended',
  'restored',
  'suspend_ended'
];

/**
 * Event types after which bookings changed: the calendar and My bookings refetch (the board too).
 * Equal to lease_server/protocol.py's BOOKING_EVENTS (tests/test_protocol.py).
 */
export const BOOKING_EVENTS = [
  'reservation_created',
  'reservation_changed',
  'reservation_cancelled',
  'reservation_ended',
  'reservation_no_show'
];

/**
 * The event a stream of changes sends for many events (GET /events?changes=true): the board asks
 * for it, so that an event costs the lease server one write per open Lab at most every 0.5 s,
 * not one per event. Its `types` name the events it stands for. Equal to lease_server/protocol.py's
 * CHANGES_EVENT (tests/test_protocol.py).
 */
export const CHANGES_EVENT = 'changed';

/** How long to coalesce events before refetching (ms). */
const REFRESH_DELAY = 100;
const RETRY_MIN = 1000;
const RETRY_MAX = 30000;
/** How often my balance is refetched at most (ms). */
const BALANCE_EVERY = 5000;
/**
 * Nodes the board asks for at first, and how many more "Show more" adds: a department's 1,250
 * nodes are neither sent to every Lab after every event nor drawn at once (GET /cluster?limit=).
 */
export const BOARD_PAGE = 64;

/**
 * How long the status bar says that a warm GPU of mine was lent out (s): until a lease of mine
 * granted after it (the notebook's next cell took GPUs again), and no longer than this.
 */
export const LENT_SHOWN_S = 600;

/** A warm GPU of mine lent to another request (its worker evicted, or suspended to host memory). */
export interface ILent {
  /** My warm lease that was evicted. */
  lease: string;
  /** The user whose request it went to. */
  to: string;
  /** When (epoch seconds, the lease server's clock). */
  at: number;
  /** Its GPUs: "box GPU 0". */
  where: string;
  /** To another notebook of mine. */
  mine: boolean;
}

/** The lent notice of an evicted warm lease of mine (live and being evicted, or ended so), else null. */
export function lentOf(lease: ILease): ILent | null {
  if (!lease.recall_for || lease.recall_cause?.code !== 'evicted') {
    return null;
  }
  return {
    lease: lease.id,
    to: lease.recall_for,
    at: lease.recalled_at ?? lease.recall_at ?? 0,
    where: `${lease.node} GPU ${lease.gpus.map(g => g.index).join(',')}`,
    mine: lease.recall_for === lease.user
  };
}

export type LiveState = 'connecting' | 'live' | 'reconnecting' | 'stopped';

export class GpuLeaseModel {
  constructor(settings: ServerConnection.ISettings = serverSettings()) {
    this._settings = settings;
  }

  /** Emitted whenever anything shown may have changed. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Emitted when bookings may have changed (an event, a booking made here): calendars refetch. */
  get bookingsChanged(): ISignal<this, void> {
    return this._bookingsSignal;
  }

  version: IVersion | null = null;
  /** Set when the handshake failed: the panel shows this instead of the board. */
  problem: string | null = null;
  /** Set when the server extension and this front end differ in version. */
  mismatch: string | null = null;
  cluster: ICluster | null = null;
  /** The board shows this pool's nodes (null: every pool's), the first `boardLimit` of them. */
  boardPool: string | null = null;
  boardLimit = BOARD_PAGE;
  leases: ILease[] = [];
  queue: IWaiter[] = [];
  user: string | null = null;
  /** The last refresh failed: what is shown is from `updatedAt`. */
  error: string | null = null;
  updatedAt: Date | null = null;
  live: LiveState = 'stopped';
  /** Release in flight, and the message of a failed one, per lease id. */
  releasing = new Set<string>();
  releaseErrors = new Map<string, string>();
  /** "Still using it" in flight, and the lease server's message when it refused, per lease id. */
  keeping = new Set<string>();
  keepErrors = new Map<string, string>();
  /** Bookings in the lease server's default window (from a day ago to two weeks ahead). */
  bookings: IBooking[] = [];
  /** The last fetch of bookings failed (e.g. a lease server without bookings). */
  bookingsError: string | null = null;
  /** My balance per pool (GET /gpulease/usage/balance), or why it could not be read. */
  balance: IBalance | null = null;
  balanceError: string | null = null;
  /** Cancel / End now in flight, and the message of a failed one, per booking id. */
  bookingBusy = new Set<string>();
  bookingErrors = new Map<string, string>();
  /** My warm GPUs lent to other requests, the newest last (the status bar says to whom). */
  lent: ILent[] = [];

  /** My bookings (mine: I may change them) that are not over: the current or next occurrence first. */
  get myBookings(): IBooking[] {
    const now = this.serverNow();
    return this.bookings
      .filter(r => r.mine && r.state === 'active' && r.instances.some(i => i.end > now && i.state !== 'released'))
      .sort((a, b) => nextInstanceStart(a, now) - nextInstanceStart(b, now));
  }

  /** The lease server's clock now, in epoch seconds (times held are computed on its clock). */
  serverNow(): number {
    return Date.now() / 1000 + this._clockOffset;
  }

  /** Whole GPUs I hold for a running call (a slice is counted apart: heldSlices; a warm one: warmGpus). */
  get heldGpus(): number {
    return this._wholeGpus(false);
  }

  /**
   * Whole GPUs of mine kept warm: a finished cell's worker waits on them for the notebook's next
   * cell, and anyone who waits gets them within seconds. Not "held": nobody waits on them.
   */
  get warmGpus(): number {
    return this._wholeGpus(true);
  }

  private _wholeGpus(warm: boolean): number {
    const cpu = this.cluster?.cpu_pool;
    return this.leases
      .filter(lease => lease.pool !== cpu && !lease.gpu_mem_mb && !!lease.warm_since === warm)
      .reduce((n, lease) => n + lease.gpus.length, 0);
  }

  /** Slices I hold for a running call: leases of part of one GPU's memory (k slices of one lease count k). */
  get heldSlices(): number {
    return this._slices(false);
  }

  /** Slices of mine kept warm for the notebook's next cell: lent out if someone waits. */
  get warmSlices(): number {
    return this._slices(true);
  }

  private _slices(warm: boolean): number {
    return this.leases
      .filter(lease => !!lease.gpu_mem_mb && !!lease.warm_since === warm)
      .reduce((n, lease) => n + lease.gpus.length, 0);
  }

  get freeGpus(): number {
    if (!this.cluster) {
      return 0;
    }
    const cpu = this.cluster.cpu_pool;
    return Object.entries(this.cluster.pools)
      .filter(([name]) => name !== cpu)
      .reduce((n, [, pool]) => n + (pool.free ?? 0), 0);
  }

  /**
   * The memory of sliced GPUs (in GPU pools, on nodes up) that no slice holds yet, in MB: room for a
   * --gpu-mem cell that "0 free" whole GPUs would hide. The pools' counts (the whole cluster, whatever
   * page of the board came); a server without them: the nodes shown.
   */
  get unpromisedMb(): number {
    if (!this.cluster) {
      return 0;
    }
    const cpu = this.cluster.cpu_pool;
    const pools = Object.entries(this.cluster.pools).filter(([name]) => name !== cpu);
    if (pools.some(([, counts]) => counts.unpromised_mb !== undefined)) {
      return pools.reduce((n, [, counts]) => n + (counts.unpromised_mb ?? 0), 0);
    }
    return this.cluster.nodes
      .filter(node => node.pool !== cpu && node.state === 'up')
      .flatMap(node => node.gpus)
      .reduce((n, gpu) => n + (gpu.slice_mem?.free_mb ?? 0), 0);
  }

  /** Handshake, first fetch, then the live stream. Safe to call again (it restarts). */
  async start(): Promise<void> {
    this._stopped = false;
    window.clearTimeout(this._retryTimer);
    if (!(await this._handshake())) {
      if (this.problem !== INSTALL_HINT && !this._stopped) {
        // The Jupyter server is restarting, or answered 5xx: try the handshake again later.
        this._retryTimer = window.setTimeout(() => void this.start(), this._retryDelay);
        this._retryDelay = Math.min(this._retryDelay * 2, RETRY_MAX);
      }
      this._emit();
      return;
    }
    await this.refresh();
    this._connect();
  }

  dispose(): void {
    this._stopped = true;
    this._disconnect();
    window.clearTimeout(this._refreshTimer);
    window.clearTimeout(this._retryTimer);
    window.clearTimeout(this._balanceTimer);
    Signal.clearData(this);
  }

  /** Show `pool`'s nodes on the board (null: every pool's), the first `limit` of them. */
  setBoardView(pool: string | null, limit: number): void {
    this.boardPool = pool;
    this.boardLimit = limit;
    void this.refresh();
  }

  /** Refetch the cluster, my leases and the queue (and, beside them, the bookings and my balance). */
  async refresh(): Promise<void> {
    const bookings = this.refreshBookings();
    const balance = this._throttledBalance();
    if (this.boardPool && this.cluster && !(this.boardPool in this.cluster.pools)) {
      this.boardPool = null; // its nodes are gone: back to every pool's
    }
    const page = new URLSearchParams({ limit: String(this.boardLimit) });
    if (this.boardPool) {
      page.set('pool', this.boardPool);
    }
    try {
      const [cluster, mine, queue] = await Promise.all([
        requestAPI<ICluster>(`cluster?${page.toString()}`, {}, this._settings),
        requestAPI<{ user: string; leases: ILease[] }>('leases', {}, this._settings),
        requestAPI<{ waiting: IWaiter[] }>('queue', {}, this._settings)
      ]);
      this.cluster = cluster;
      this._clockOffset = cluster.now - Date.now() / 1000;
      const before = this.leases;
      this.leases = mine.leases;
      void this.noteLent(before, mine.leases);
      this.user = mine.user;
      this.queue = queue.waiting;
      this.error = null;
      this.updatedAt = new Date();
      for (const id of this.releaseErrors.keys()) {
        if (!this.leases.some(lease => lease.id === id)) {
          this.releaseErrors.delete(id);
        }
      }
      // A refused keep matters while the lease is still warned (gone, or busy again: forget it).
      for (const id of this.keepErrors.keys()) {
        if (!this.leases.some(lease => lease.id === id && lease.reclaim_at)) {
          this.keepErrors.delete(id);
        }
      }
    } catch (error) {
      this.error = describe(error);
    }
    this._emit();
    await Promise.all([bookings, balance]);
  }

  /**
   * The moment a warm GPU of mine is lent out: a lease being evicted for someone's request says so
   * while it lives (recall_for); one that was warm and is gone since `before` is read once more
   * (its ended record keeps whom it went to). A notice stays until a lease of mine granted after it,
   * or LENT_SHOWN_S.
   */
  async noteLent(before: ILease[], now: ILease[]): Promise<void> {
    const live = new Set(now.map(lease => lease.id));
    const known = (id: string) => this.lent.some(l => l.lease === id);
    const found = now.map(lentOf).filter((l): l is ILent => l !== null && !known(l.lease));
    const gone = before.filter(lease => lease.warm_since && !live.has(lease.id) && !known(lease.id));
    await Promise.all(
      gone.map(async lease => {
        try {
          const ended = await requestAPI<ILease>(`leases/${encodeURIComponent(lease.id)}`, {}, this._settings);
          const lent = lentOf(ended);
          if (lent && !known(lent.lease)) {
            found.push(lent);
          }
        } catch {
          // forgotten by the lease server, or it is away: nothing to say
        }
      })
    );
    const now_s = this.serverNow();
    const kept = [...this.lent, ...found]
      .filter(l => now_s - l.at < LENT_SHOWN_S && !this.leases.some(m => m.id !== l.lease && m.created_at > l.at))
      .sort((a, b) => a.at - b.at);
    const changed = kept.length !== this.lent.length || kept.some((l, i) => l !== this.lent[i]);
    this.lent = kept;
    if (changed) {
      this._emit();
    }
  }

  /**
   * My balance, refetched with the board but at most every BALANCE_EVERY ms (the lease server
   * estimates each pool's next wait for it: not a thing to ask at every event of a busy cluster).
   */
  private _throttledBalance(): Promise<void> {
    const wait = this._balanceAt + BALANCE_EVERY - Date.now();
    if (wait <= 0) {
      this._balanceAt = Date.now();
      return this.refreshBalance();
    }
    if (!this._balanceTimer) {
      this._balanceTimer = window.setTimeout(() => {
        this._balanceTimer = 0;
        this._balanceAt = Date.now();
        void this.refreshBalance();
      }, wait);
    }
    return Promise.resolve();
  }

  /** Refetch my balance (quota left, place in fair share, next cell's wait; the status bar's tooltip). */
  async refreshBalance(): Promise<void> {
    try {
      this.balance = await requestAPI<IBalance>('usage/balance', {}, this._settings);
      this.balanceError = null;
    } catch (error) {
      // A lease server without the endpoint (older than the usage rollups) leaves the balance out.
      this.balance = null;
      this.balanceError = describe(error);
    }
    this._emit();
  }

  /** Refetch the bookings in the lease server's default window (for My bookings). */
  async refreshBookings(): Promise<void> {
    try {
      const answer = await requestAPI<{ bookings: IBooking[]; now: number }>(
        'bookings',
        {},
        this._settings
      );
      this.bookings = answer.bookings;
      this.bookingsError = null;
      for (const id of this.bookingErrors.keys()) {
        if (!this.bookings.some(r => r.id === id && r.state === 'active')) {
          this.bookingErrors.delete(id);
        }
      }
    } catch (error) {
      this.bookingsError = describe(error);
    }
    this._emit();
  }

  /** GET /gpulease/usage/summary with these arguments (the Usage tab): what the lease server lets this user see. */
  async usageSummary(args: URLSearchParams): Promise<IUsageSummary> {
    return requestAPI<IUsageSummary>(`usage/summary?${args.toString()}`, {}, this._settings);
  }

  /** Everyone's bookings of a pool that overlap [from, to) (for the calendar). */
  async fetchBookings(pool: string, from: Date, to: Date): Promise<IBooking[]> {
    const query = new URLSearchParams({
      pool,
      from: String(Math.floor(from.getTime() / 1000)),
      to: String(Math.ceil(to.getTime() / 1000))
    });
    const answer = await requestAPI<{ bookings: IBooking[] }>(
      `bookings?${query.toString()}`,
      {},
      this._settings
    );
    return answer.bookings;
  }

  /**
   * Would this booking fit? Resolves when it would; rejects with the lease server's error otherwise
   * (a GpuLeaseError 409 reservation_clash whose details say what is in the way and what would fit).
   */
  async checkBooking(booking: IBookingRequest): Promise<{ fits: boolean; node: string }> {
    return requestAPI('bookings?dry_run=true', jsonBody('POST', booking), this._settings);
  }

  /** Would this change of one of my bookings fit? Like checkBooking. */
  async checkChange(id: string, changes: Partial<IBookingRequest>): Promise<{ fits: boolean; node: string }> {
    const path = `bookings/${encodeURIComponent(id)}?dry_run=true`;
    return requestAPI(path, jsonBody('PATCH', changes), this._settings);
  }

  /** Book GPUs; rejects like checkBooking when the booking does not fit. */
  async book(booking: IBookingRequest): Promise<IBooking> {
    const made = await requestAPI<IBooking>('bookings', jsonBody('POST', booking), this._settings);
    this._bookingsChanged();
    return made;
  }

  /** Change one of my bookings (any subset of the fields; a weekly booking changes as a whole). */
  async changeBooking(id: string, changes: Partial<IBookingRequest>): Promise<IBooking> {
    const changed = await requestAPI<IBooking>(
      `bookings/${encodeURIComponent(id)}`,
      jsonBody('PATCH', changes),
      this._settings
    );
    this._bookingsChanged();
    return changed;
  }

  /** Cancel one of my bookings (all its occurrences). The error, if any, is kept per booking. */
  async cancelBooking(id: string): Promise<boolean> {
    return this._bookingAction(id, 'cancel', `bookings/${encodeURIComponent(id)}`, 'DELETE');
  }

  /** "I'm done": end the current occurrence of one of my bookings; its GPUs go back to the pool. */
  async endBooking(id: string): Promise<boolean> {
    return this._bookingAction(id, 'end', `bookings/${encodeURIComponent(id)}/end`, 'POST');
  }

  private async _bookingAction(id: string, verb: string, path: string, method: string): Promise<boolean> {
    this.bookingBusy.add(id);
    this.bookingErrors.delete(id);
    this._emit();
    let ok = true;
    try {
      await requestAPI(path, { method }, this._settings);
    } catch (error) {
      ok = false;
      this.bookingErrors.set(id, `could not ${verb} ${id}: ${describe(error)}`);
    } finally {
      this.bookingBusy.delete(id);
    }
    this._bookingsChanged();
    return ok;
  }

  private _bookingsChanged(): void {
    this._bookingsSignal.emit(undefined);
    void this.refresh(); // My bookings, and the board (reserved GPUs)
  }

  /** Release one of my leases; the board follows from the event stream (and a refetch now). */
  async release(id: string): Promise<void> {
    this.releasing.add(id);
    this.releaseErrors.delete(id);
    this._emit();
    try {
      await requestAPI(`leases/${encodeURIComponent(id)}`, { method: 'DELETE' }, this._settings);
    } catch (error) {
      this.releaseErrors.set(id, `could not release ${id}: ${describe(error)}`);
    } finally {
      this.releasing.delete(id);
    }
    await this.refresh();
  }

  /**
   * "Still using it": reset the idle clock of one of my idle-warned leases, so it is not reclaimed.
   * The lease server limits how often; its refusal says so, and is shown with the lease.
   */
  async keep(id: string): Promise<void> {
    this.keeping.add(id);
    this.keepErrors.delete(id);
    this._emit();
    try {
      await requestAPI(`leases/${encodeURIComponent(id)}/keep`, { method: 'POST' }, this._settings);
    } catch (error) {
      this.keepErrors.set(id, `could not keep ${id}: ${describe(error)}`);
    } finally {
      this.keeping.delete(id);
    }
    await this.refresh();
  }

  private async _handshake(): Promise<boolean> {
    try {
      this.version = await requestAPI<IVersion>('version', {}, this._settings);
    } catch (error) {
      const missing = error instanceof GpuLeaseError && (error.status === 404 || error.code === 'bad_answer');
      this.problem = missing ? INSTALL_HINT : `gpulease: ${describe(error)}`;
      return false;
    }
    this.problem = null;
    this.mismatch =
      this.version.version === VERSION
        ? null
        : `the gpulease server extension is version ${this.version.version} but this page runs ` +
          `${VERSION}: reinstall gpulease (pip install gpulease), restart JupyterLab and reload the page`;
    const lease = this.version.lease_server;
    this.user = lease.user ?? null;
    if (!lease.reachable || lease.error) {
      this.error = `lease server ${lease.url ?? '(not configured)'}: ${lease.error}`;
    }
    return true;
  }

  private _connect(): void {
    if (this._stopped) {
      return;
    }
    this._disconnect();
    const settings = this._settings;
    const query = new URLSearchParams();
    // One `changed` event for many (what is drawn is refetched anyway); a lease server without
    // changes streams sends each event, and the listeners below serve both.
    query.set('changes', 'true');
    if (settings.appendToken && settings.token) {
      query.set('token', settings.token);
    }
    // An EventSource cannot send the X-XSRFToken header that every other request carries, and a
    // JupyterHub single-user server accepts its login cookie on a script's GET only with the XSRF
    // token: pass it as _xsrf, as a form would (a plain Jupyter server ignores it on a GET).
    const xsrf = xsrfCookie();
    if (xsrf) {
      query.set('_xsrf', xsrf);
    }
    const search = query.toString();
    const url = apiUrl(settings, 'events') + (search ? `?${search}` : '');
    this.live = this.live === 'stopped' ? 'connecting' : this.live;
    const source = new EventSource(url, { withCredentials: true });
    this._source = source;
    source.onopen = () => {
      const wasDown = this.live !== 'live';
      this.live = 'live';
      this._retryDelay = RETRY_MIN;
      if (wasDown) {
        this._bookingsSignal.emit(undefined);
        void this.refresh(); // events may have been missed while the stream was down
      } else {
        this._emit();
      }
    };
    source.onerror = () => {
      if (source.readyState === EventSource.CLOSED) {
        // The proxy answered with an error (e.g. 503, lease server away): retry with backoff,
        // and refetch so that the page shows the reason.
        this.live = 'reconnecting';
        this._disconnect();
        void this.refresh();
        this._retryTimer = window.setTimeout(() => this._connect(), this._retryDelay);
        this._retryDelay = Math.min(this._retryDelay * 2, RETRY_MAX);
      } else {
        this.live = 'reconnecting'; // EventSource reconnects by itself, with Last-Event-ID
        this._emit();
      }
    };
    source.addEventListener(CHANGES_EVENT, (ev: MessageEvent) => {
      let types: string[] = [];
      try {
        types = JSON.parse(ev.data).types ?? [];
      } catch {
        types = BOOKING_EVENTS; // unreadable: refetch everything
      }
      if (types.some(t => BOOKING_EVENTS.includes(t))) {
        this._bookingsSignal.emit(undefined);
      }
      this._scheduleRefresh();
    });
    for (const type of BOARD_EVENTS) {
      source.addEventListener(type, () => this._scheduleRefresh());
    }
    for (const type of BOOKING_EVENTS) {
      source.addEventListener(type, () => {
        this._bookingsSignal.emit(undefined);
        this._scheduleRefresh();
      });
    }
  }

  private _disconnect(): void {
    if (this._source) {
      this._source.onopen = this._source.onerror = null;
      this._source.close();
      this._source = null;
    }
  }

  private _scheduleRefresh(): void {
    if (this._refreshTimer) {
      return;
    }
    this._refreshTimer = window.setTimeout(() => {
      this._refreshTimer = 0;
      void this.refresh();
    }, REFRESH_DELAY);
  }

  private _emit(): void {
    this._changed.emit(undefined);
  }

  private _settings: ServerConnection.ISettings;
  private _changed = new Signal<this, void>(this);
  private _bookingsSignal = new Signal<this, void>(this);
  private _source: EventSource | null = null;
  private _refreshTimer = 0;
  private _retryTimer = 0;
  private _balanceTimer = 0;
  private _balanceAt = 0;
  private _retryDelay = RETRY_MIN;
  private _clockOffset = 0;
  private _stopped = false;
}

/** The _xsrf cookie's value, read as JupyterLab's ServerConnection reads it (the last one). */
function xsrfCookie(): string | undefined {
  let value: string | undefined;
  for (const part of document.cookie.split(';')) {
    const trimmed = part.trim();
    if (trimmed.startsWith('_xsrf=')) {
      value = trimmed.substring('_xsrf='.length);
    }
  }
  return value;
}

function jsonBody(method: string, body: unknown): RequestInit {
  return { method, body: JSON.stringify(body), headers: { 'Content-Type': 'application/json' } };
}

/** When the current or next occurrence of a booking starts (epoch seconds). */
export function nextInstanceStart(r: IBooking, now: number): number {
  const next = r.instances.find(i => i.end > now && i.state !== 'released');
  return next ? next.start : r.start;
}

export function describe(error: unknown): string {
  if (error instanceof GpuLeaseError) {
    return error.message;
  }
  return error instanceof Error ? error.message : String(error);
}

/** The idle-reclaim countdown: "idle — reclaimed in 27 s" (or "in 1m45s"; "now" once it is due). */
export function reclaimCountdown(reclaimAt: number, now: number): string {
  const s = Math.floor(reclaimAt - now);
  if (s <= 0) {
    return 'idle — reclaimed now';
  }
  return `idle — reclaimed in ${s < 60 ? `${s} s` : duration(s)}`;
}

/** "42s", "3m05s", "2h07m", "3d04h". */
export function duration(seconds: number): string {
  const s = Math.max(0, Math.floor(seconds));
  if (s < 60) {
    return `${s}s`;
  }
  const pad = (n: number) => String(n).padStart(2, '0');
  if (s < 3600) {
    return `${Math.floor(s / 60)}m${pad(s % 60)}s`;
  }
  if (s < 86400) {
    return `${Math.floor(s / 3600)}h${pad(Math.floor((s % 3600) / 60))}m`;
  }
  return `${Math.floor(s / 86400)}d${pad(Math.floor((s % 86400) / 3600))}h`;
}

/** GPU memory as people read it: "10 GB" (1024 MB each), "1.5 GB", "512 MB". */
export function memSize(mb: number): string {
  if (mb >= 1024) {
    return `${(mb / 1024).toFixed(1).replace(/\.0$/, '')} GB`;
  }
  return `${Math.round(mb)} MB`;
}
