/**
 * The booking form's logic, apart from its view: what the form was opened for, its fields, a
 * booking made of them (or what is wrong with them), the changes a PATCH sends, and what the form
 * says of the lease server's answer (fits, a clash, an error).
 */
import { GpuLeaseError, IBooking, IBookingRequest, IClash, IInstance } from './api';
import { formatWindow, fromLocalInput, gpuCount } from './clock';
import { describe } from './model';

/** What the dialog was opened for. */
export type DialogTarget =
  | { mode: 'new'; start: Date; end: Date; fromDrag: boolean }
  | { mode: 'edit'; booking: IBooking; instance: IInstance | null };

/** The form's fields, as the inputs hold them. */
export interface IFields {
  pool: string;
  gpus: string;
  start: string;
  end: string;
  owner: string;
  note: string;
  repeat: 'none' | 'weekly';
  occurrences: string;
  colocate: boolean;
}

/** What the form says of the booking: nothing yet, checking, fits, invalid, an error, or a clash. */
export type Check =
  | { state: 'idle' | 'checking' | 'fits' }
  | { state: 'invalid' | 'error'; message: string }
  | { state: 'clash'; message: string; clash: IClash | null; serverMessage?: string };

/** The fields as a booking, or what is wrong with them. */
export function toBooking(f: IFields): IBookingRequest | string {
  const gpus = Number(f.gpus);
  if (!Number.isInteger(gpus) || gpus < 1) {
    return 'GPUs must be a whole number, 1 or more';
  }
  const start = fromLocalInput(f.start);
  const end = fromLocalInput(f.end);
  if (isNaN(start) || isNaN(end)) {
    return 'give a start and an end (date and time)';
  }
  if (end <= start) {
    return 'the end must be after the start';
  }
  const booking: IBookingRequest = { pool: f.pool, gpus, start, end, repeat: f.repeat, colocate: f.colocate };
  if (f.repeat === 'weekly') {
    const n = Number(f.occurrences);
    if (!Number.isInteger(n) || n < 1 || n > 52) {
      return 'weeks must be a whole number from 1 to 52';
    }
    booking.occurrences = n;
  }
  if (f.owner.trim()) {
    booking.owner = f.owner.trim();
  }
  if (f.note.trim()) {
    booking.note = f.note.trim();
  }
  return booking;
}

/** Whether two epoch-second times fall in the same minute: the form writes times to the minute. */
function sameMinute(a: unknown, b: unknown): boolean {
  return typeof a === 'number' && typeof b === 'number' && Math.floor(a / 60) === Math.floor(b / 60);
}

/**
 * The fields of a booking that differ from an existing one (what a PATCH sends). A start or end
 * the form shows unchanged is not sent: the form holds minutes, and a booking made by the CLI or
 * the API may have seconds, which would otherwise make every save a change of time (refused over
 * the owner's share, and undoing "End now").
 */
export function changesOf(existing: IBooking, booking: IBookingRequest): Partial<IBookingRequest> {
  const before: Record<string, unknown> = {
    pool: existing.pool,
    gpus: existing.gpus,
    start: existing.start,
    end: existing.end,
    owner: existing.owner,
    note: existing.note ?? '',
    repeat: existing.repeat,
    occurrences: existing.occurrences,
    colocate: !!existing.colocate
  };
  const after: Record<string, unknown> = { note: '', owner: existing.owner, ...booking };
  const changes: Record<string, unknown> = {};
  for (const key of Object.keys(after)) {
    const unmoved = (key === 'start' || key === 'end') && sameMinute(after[key], before[key]);
    if (after[key] !== before[key] && !unmoved) {
      changes[key] = after[key];
    }
  }
  return changes as Partial<IBookingRequest>;
}

/** Whether an error's details are a clash (a 409 reservation_clash's). */
function isClash(details: unknown): details is IClash {
  return typeof details === 'object' && details !== null && Array.isArray((details as IClash).clashes);
}

/**
 * A 409 reservation_clash as the clash panel shows it. The lease server's message writes times in
 * UTC; the panel writes every time in the browser's zone (as the calendar does), so the headline is
 * made here from the booking and the details (the server's message stays as its tooltip).
 */
export function clashOf(error: unknown, booking: IBookingRequest | null): Check {
  if (error instanceof GpuLeaseError && error.status === 409) {
    const clash = isClash(error.details) ? error.details : null;
    if (clash && booking) {
      const weekly = booking.repeat === 'weekly' ? ` (weekly, ${booking.occurrences ?? 1} times)` : '';
      const message =
        `${gpuCount(booking.gpus)} of ${booking.pool}, ${formatWindow(booking.start, booking.end)}${weekly}, ` +
        `would over-book it (${clash.capacity} can be booked)`;
      return { state: 'clash', message, clash, serverMessage: error.message };
    }
    return { state: 'clash', message: error.message, clash };
  }
  return { state: 'error', message: describe(error) };
}
