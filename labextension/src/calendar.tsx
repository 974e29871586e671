/**
 * The booking calendar: everyone's bookings of one pool in a week or day view (FullCalendar), live
 * from the event stream. Drag over free time to book it; click a booking to change or cancel it
 * (yours) or to see it (anyone's). "New booking…" opens the same form without a mouse.
 *
 * The form asks the lease server (a dry run) whether the booking fits while it is being filled in,
 * and shows a clash as the lease server describes it: the bookings in the way, how many GPUs would
 * fit, and the nearest windows that fit, each one applied with one click. Times are entered and
 * shown in the browser's time zone and sent as epoch seconds (the lease server stores UTC).
 */
import { Calendar, EventInput } from '@fullcalendar/core';
import interactionPlugin from '@fullcalendar/interaction';
import timeGridPlugin from '@fullcalendar/timegrid';
import React, { useEffect, useRef, useState } from 'react';

import { GpuLeaseError, IBooking, IBookingRequest, IClash, IInstance } from './api';
import { confirmAction } from './confirm';
import { GpuLeaseModel, describe } from './model';

/** Where the calendar was (pool, view, day), kept while the Board tab is shown. */
export interface ICalendarPlace {
  pool: string;
  view: string;
  date: Date | null;
  /** The newest "New booking…" request (a command's seq) the form was opened for. */
  newBookingSeen: number;
}

const DAYS = ['Sun', 'Mon', 'Tue', 'Wed', 'Thu', 'Fri', 'Sat'];
const MONTHS = ['Jan', 'Feb', 'Mar', 'Apr', 'May', 'Jun', 'Jul', 'Aug', 'Sep', 'Oct', 'Nov', 'Dec'];
const pad = (n: number) => String(n).padStart(2, '0');

/**
 * The browser locale's clock: true where it reads 12-hour (en-US), false for 24-hour (de-DE, en-GB).
 * Every time on the page (grid, lists, clash) follows it, as the form's native date-time inputs do.
 */
export const HOUR12 = new Intl.DateTimeFormat(undefined, { hour: 'numeric' }).resolvedOptions().hour12 === true;

/** "10:00", or "10:00 AM" where the locale's clock is 12-hour. */
function clock(d: Date): string {
  if (!HOUR12) {
    return `${pad(d.getHours())}:${pad(d.getMinutes())}`;
  }
  return `${((d.getHours() + 11) % 12) + 1}:${pad(d.getMinutes())} ${d.getHours() < 12 ? 'AM' : 'PM'}`;
}

/** "Tue 24 Nov 10:00" in the browser's time zone, on the locale's clock. */
export function formatTime(epoch: number): string {
  const d = new Date(epoch * 1000);
  return `${DAYS[d.getDay()]} ${d.getDate()} ${MONTHS[d.getMonth()]} ${clock(d)}`;
}

/** "Tue 24 Nov 10:00–12:00", or with both dates when the window spans midnight. */
export function formatWindow(start: number, end: number): string {
  const a = new Date(start * 1000);
  const b = new Date(end * 1000);
  const sameDay = a.toDateString() === b.toDateString();
  return `${formatTime(start)}–${sameDay ? clock(b) : formatTime(end)}`;
}

export function gpuCount(n: number): string {
  return `${n} GPU${n === 1 ? '' : 's'}`;
}

/** A Date as the value of an <input type="datetime-local"> (local time, minutes). */
function toLocalInput(date: Date): string {
  return (
    `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())}` +
    `T${pad(date.getHours())}:${pad(date.getMinutes())}`
  );
}

/** The value of a datetime-local input as epoch seconds (it is local time), or NaN. */
function fromLocalInput(value: string): number {
  if (!/^\d{4}-\d\d-\d\dT\d\d:\d\d(:\d\d)?$/.test(value)) {
    return NaN;
  }
  return new Date(value).getTime() / 1000; // a date-time without an offset is local time
}

const ZONE = Intl.DateTimeFormat().resolvedOptions().timeZone;

/**
 * Ask, then cancel one of my bookings (every week of a weekly one): true once cancelled, false when
 * the cancel failed (model.bookingErrors says why), null when the user kept the booking.
 */
export async function confirmCancelBooking(model: GpuLeaseModel, r: IBooking): Promise<boolean | null> {
  const weekly = r.repeat === 'weekly' ? `, every week of it (${r.occurrences} weeks)` : '';
  const ok = await confirmAction(
    `Cancel booking ${r.id}?`,
    `${gpuCount(r.gpus)} of ${r.pool}, ${formatWindow(r.start, r.end)}${weekly}: ` +
      'the GPUs go back to everyone. This cannot be undone.',
    'Cancel booking'
  );
  return ok ? model.cancelBooking(r.id) : null;
}

/** One calendar event per occurrence of a booking. */
function toEvents(bookings: IBooking[]): EventInput[] {
  const events: EventInput[] = [];
  for (const r of bookings) {
    if (r.state !== 'active') {
      continue;
    }
    for (const i of r.instances) {
      events.push({
        id: `${r.id}#${i.k}`,
        start: i.start * 1000,
        end: i.end * 1000,
        title: `${r.owner} · ${gpuCount(r.gpus)}`,
        classNames: [
          'jp-GpuLease-booking',
          `jp-GpuLease-booking-${i.state}`,
          ...(r.mine ? ['jp-GpuLease-bookingMine'] : [])
        ],
        extendedProps: { booking: r, instance: i }
      });
    }
  }
  return events;
}

function bookingName(r: IBooking, i: IInstance): string {
  const parts = [`Booking ${r.id}: ${r.owner}, ${gpuCount(r.gpus)}, ${formatWindow(i.start, i.end)}`];
  if (r.repeat === 'weekly') {
    parts.push(`weekly, week ${i.k + 1} of ${r.occurrences}`);
  }
  if (i.state !== 'upcoming') {
    parts.push(i.state === 'active' ? 'now' : i.state);
  }
  if (r.note) {
    parts.push(r.note);
  }
  if (r.mine) {
    parts.push('yours: click to change or cancel');
  }
  return parts.join(', ');
}

/** What the dialog was opened for. */
type DialogTarget =
  | { mode: 'new'; start: Date; end: Date; fromDrag: boolean }
  | { mode: 'edit'; booking: IBooking; instance: IInstance | null };

export function BookingCalendar(props: {
  model: GpuLeaseModel;
  place: ICalendarPlace;
  /** A "New booking…" command's seq: the form opens once for each new one. */
  newBooking?: number;
}): JSX.Element {
  const { model, place, newBooking = 0 } = props;
  const pools = Object.keys(model.cluster?.pools ?? {}).sort();
  if (!place.pool || !pools.includes(place.pool)) {
    const preferred = model.cluster?.default_pool;
    place.pool = preferred && pools.includes(preferred) ? preferred : (pools[0] ?? '');
  }
  const [pool, setPool] = useState(place.pool);
  const [dialog, setDialog] = useState<DialogTarget | null>(null);
  const [loadError, setLoadError] = useState<string | null>(null);
  const [announce, setAnnounce] = useState('');
  const host = useRef<HTMLDivElement>(null);
  const calendar = useRef<Calendar | null>(null);
  const poolRef = useRef(pool);
  poolRef.current = pool;

  useEffect(() => {
    if (!host.current) {
      return;
    }
    const cal = new Calendar(host.current, {
      plugins: [timeGridPlugin, interactionPlugin],
      initialView: place.view,
      initialDate: place.date ?? undefined,
      headerToolbar: { left: 'prev,next today', center: 'title', right: 'timeGridWeek,timeGridDay' },
      // The week shown starts today (and the days after it): tomorrow is always on screen.
      firstDay: new Date().getDay(),
      allDaySlot: false,
      height: 620,
      slotDuration: '00:30:00',
      // The locale's clock, as the form's inputs and every other time on the page.
      slotLabelFormat: { hour: HOUR12 ? 'numeric' : '2-digit', minute: '2-digit', hour12: HOUR12 },
      eventTimeFormat: { hour: HOUR12 ? 'numeric' : '2-digit', minute: '2-digit', hour12: HOUR12 },
      scrollTime: `${pad(Math.max(0, new Date().getHours() - 1))}:00:00`,
      nowIndicator: true,
      selectable: true,
      selectMirror: true,
      unselectAuto: false,
      eventInteractive: true,
      // Drag only over time that has not passed yet.
      selectAllow: span => span.end.getTime() > Date.now(),
      events: (info, success, failure) => {
        const wanted = poolRef.current;
        if (!wanted) {
          success([]);
          return;
        }
        model
          .fetchBookings(wanted, info.start, info.end)
          .then(rs => {
            setLoadError(null);
            success(toEvents(rs));
          })
          .catch(error => {
            setLoadError(`could not load the bookings of ${wanted}: ${describe(error)}`);
            failure(error);
          });
      },
      select: info => setDialog({ mode: 'new', start: info.start, end: info.end, fromDrag: true }),
      eventClick: info => {
        info.jsEvent.preventDefault();
        const { booking, instance } = info.event.extendedProps as {
          booking?: IBooking;
          instance?: IInstance;
        };
        if (booking) {
          setDialog({ mode: 'edit', booking, instance: instance ?? null });
        }
      },
      eventContent: arg => {
        // The mirror of a selection being dragged is an event too, without a booking.
        const r = arg.event.extendedProps.booking as IBooking | undefined;
        const nodes: Node[] = [];
        const time = document.createElement('div');
        time.className = 'jp-GpuLease-bookingTime';
        time.textContent = arg.timeText;
        const who = document.createElement('div');
        who.className = 'jp-GpuLease-bookingWho';
        who.textContent = arg.event.title;
        nodes.push(time, who);
        if (r?.note) {
          const note = document.createElement('div');
          note.className = 'jp-GpuLease-bookingNote';
          note.textContent = r.note;
          nodes.push(note);
        }
        return { domNodes: nodes };
      },
      eventDidMount: arg => {
        const { booking, instance } = arg.event.extendedProps as {
          booking?: IBooking;
          instance?: IInstance;
        };
        if (!booking || !instance) {
          return; // the mirror of a selection
        }
        const name = bookingName(booking, instance);
        arg.el.setAttribute('role', 'button');
        arg.el.setAttribute('aria-label', name);
        arg.el.setAttribute('title', name);
      },
      datesSet: info => {
        place.view = info.view.type;
        place.date = info.view.currentStart;
      }
    });
    calendar.current = cal;
    cal.render();
    const refetch = () => cal.refetchEvents();
    model.bookingsChanged.connect(refetch);
    // The panel is a Lumino widget: FullCalendar sees window resizes, not the panel's.
    const observer = new ResizeObserver(() => cal.updateSize());
    observer.observe(host.current);
    return () => {
      observer.disconnect();
      model.bookingsChanged.disconnect(refetch);
      cal.destroy();
      calendar.current = null;
    };
  }, [model]);

  const shownPool = useRef(pool);
  useEffect(() => {
    if (shownPool.current !== pool) {
      shownPool.current = pool;
      calendar.current?.refetchEvents();
    }
  }, [pool]);

  const close = (message?: string) => {
    setDialog(null);
    calendar.current?.unselect();
    if (message) {
      setAnnounce(message);
    }
  };

  const openNew = () => {
    const start = new Date();
    start.setMinutes(0, 0, 0);
    start.setHours(start.getHours() + 1);
    setDialog({ mode: 'new', start, end: new Date(start.getTime() + 3600_000), fromDrag: false });
  };

  useEffect(() => {
    if (newBooking > place.newBookingSeen) {
      place.newBookingSeen = newBooking;
      openNew();
    }
  }, [newBooking]);

  const capacity = model.cluster?.pools[pool];
  return (
    <div className="jp-GpuLease-calendar">
      <div className="jp-GpuLease-calendarBar">
        <label className="jp-GpuLease-inline">
          Pool{' '}
          <select
            className="jp-mod-styled"
            aria-label="Calendar pool"
            value={pool}
            onChange={e => {
              place.pool = e.target.value;
              setPool(e.target.value);
            }}
          >
            {pools.map(p => (
              <option key={p} value={p}>
                {p}
              </option>
            ))}
          </select>
        </label>
        {capacity && <span className="jp-GpuLease-hint">{gpuCount(capacity.gpus ?? 0)} in this pool</span>}
        <button className="jp-mod-styled jp-mod-accept" onClick={openNew}>
          New booking…
        </button>
        <span className="jp-GpuLease-hint">
          Drag over free time to book it; click a booking to change or cancel it. Times in {ZONE}.
        </span>
      </div>
      <div role="status" className="jp-GpuLease-announce" aria-label="booking result">
        {announce}
      </div>
      {loadError && (
        <div role="alert" className="jp-GpuLease-error">
          {loadError}
        </div>
      )}
      <div ref={host} className="jp-GpuLease-fc" aria-label={`bookings of ${pool}`} />
      {dialog && (
        <BookingDialog
          key={dialog.mode === 'edit' ? dialog.booking.id : `new-${dialog.start.getTime()}`}
          model={model}
          pools={pools}
          pool={pool}
          target={dialog}
          onClose={close}
        />
      )}
    </div>
  );
}

/** The form's fields, as the inputs hold them. */
interface IFields {
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

type Check =
  | { state: 'idle' | 'checking' | 'fits' }
  | { state: 'invalid' | 'error'; message: string }
  | { state: 'clash'; message: string; clash: IClash | null; serverMessage?: string };

/** The fields as a booking, or what is wrong with them. */
function toBooking(f: IFields): IBookingRequest | string {
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

/** The fields of a booking that differ from an existing one (what a PATCH sends). */
function changesOf(existing: IBooking, booking: IBookingRequest): Partial<IBookingRequest> {
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
    if (after[key] !== before[key]) {
      changes[key] = after[key];
    }
  }
  return changes as Partial<IBookingRequest>;
}

/**
 * A 409 reservation_clash as the clash panel shows it. The lease server's message writes times in
 * UTC; the panel writes every time in the browser's zone (as the calendar does), so the headline is
 * made here from the booking and the details (the server's message stays as its tooltip).
 */
function clashOf(error: unknown, booking: IBookingRequest | null): Check {
  if (error instanceof GpuLeaseError && error.status === 409) {
    const d = error.details;
    const clash = d && Array.isArray(d.clashes) ? (d as IClash) : null;
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

function BookingDialog(props: {
  model: GpuLeaseModel;
  pools: string[];
  pool: string;
  target: DialogTarget;
  onClose: (message?: string) => void;
}): JSX.Element {
  const { model, pools, target, onClose } = props;
  const existing = target.mode === 'edit' ? target.booking : null;
  const editable = !existing || existing.mine;
  const [fields, setFields] = useState<IFields>(() =>
    existing
      ? {
          pool: existing.pool,
          gpus: String(existing.gpus),
          start: toLocalInput(new Date(existing.start * 1000)),
          end: toLocalInput(new Date(existing.end * 1000)),
          owner: existing.owner,
          note: existing.note ?? '',
          repeat: existing.repeat === 'weekly' ? 'weekly' : 'none',
          occurrences: String(existing.occurrences || 1),
          colocate: !!existing.colocate
        }
      : {
          pool: props.pool,
          gpus: '1',
          start: toLocalInput(target.mode === 'new' ? target.start : new Date()),
          end: toLocalInput(target.mode === 'new' ? target.end : new Date()),
          owner: '',
          note: '',
          repeat: 'none',
          occurrences: '4',
          colocate: false
        }
  );
  // The dry run (new bookings) and the answer to saving, shown in one place.
  const [check, setCheck] = useState<Check>({ state: 'idle' });
  const [saved, setSaved] = useState<Check | null>(null);
  const [busy, setBusy] = useState<string | null>(null);
  const seq = useRef(0);
  const dialog = useRef<HTMLDivElement>(null);
  const saveButton = useRef<HTMLButtonElement>(null);
  const titleId = `jp-GpuLease-dialogTitle-${existing?.id ?? 'new'}`;

  const set = (changes: Partial<IFields>) => {
    setFields(f => ({ ...f, ...changes }));
    setSaved(null);
  };

  useEffect(() => {
    const first = dialog.current?.querySelector<HTMLElement>('input, select, button');
    first?.focus();
  }, []);

  // Ask the lease server (a dry run) whether the booking, or the change, fits, a moment after the
  // fields last changed.
  useEffect(() => {
    if (!editable) {
      return;
    }
    const booking = toBooking(fields);
    if (typeof booking === 'string') {
      setCheck({ state: 'invalid', message: booking });
      return;
    }
    const changes = existing ? changesOf(existing, booking) : null;
    if (changes && Object.keys(changes).length === 0) {
      setCheck({ state: 'idle' });
      return;
    }
    const mine = ++seq.current;
    setCheck({ state: 'checking' });
    const timer = window.setTimeout(() => {
      (existing && changes ? model.checkChange(existing.id, changes) : model.checkBooking(booking)).then(
        () => mine === seq.current && setCheck({ state: 'fits' }),
        error => mine === seq.current && setCheck(clashOf(error, booking))
      );
    }, 250);
    return () => window.clearTimeout(timer);
  }, [fields]);

  const save = async () => {
    const booking = toBooking(fields);
    if (typeof booking === 'string') {
      setSaved({ state: 'invalid', message: booking });
      return;
    }
    setBusy('save');
    setSaved(null);
    try {
      if (existing) {
        const changes = changesOf(existing, booking);
        if (Object.keys(changes).length === 0) {
          onClose();
          return;
        }
        const changed = await model.changeBooking(existing.id, changes);
        onClose(
          `Changed booking ${changed.id}: ${changed.owner}, ${gpuCount(changed.gpus)}, ` +
            formatWindow(changed.start, changed.end)
        );
      } else {
        const made = await model.book(booking);
        onClose(
          `Booked ${made.id}: ${made.owner}, ${gpuCount(made.gpus)} of ${made.pool}, ` +
            formatWindow(made.start, made.end)
        );
      }
    } catch (error) {
      const answer = clashOf(error, booking);
      setSaved(answer.state === 'clash' ? { ...answer, message: `Refused: ${answer.message}` } : answer);
    } finally {
      setBusy(null);
    }
  };

  const act = async (what: 'cancel' | 'end') => {
    if (!existing) {
      return;
    }
    setBusy(what);
    const ok = what === 'cancel' ? await confirmCancelBooking(model, existing) : await model.endBooking(existing.id);
    setBusy(null);
    if (ok === null) {
      return; // not confirmed: the booking stays, and the form with it
    }
    if (ok) {
      onClose(what === 'cancel' ? `Cancelled booking ${existing.id}` : `Ended booking ${existing.id} now`);
    } else {
      setSaved({ state: 'error', message: model.bookingErrors.get(existing.id) ?? `could not ${what} it` });
    }
  };

  const apply = (change: { start?: number; end?: number; gpus?: number }) => {
    set({
      ...(change.start !== undefined ? { start: toLocalInput(new Date(change.start * 1000)) } : {}),
      ...(change.end !== undefined ? { end: toLocalInput(new Date(change.end * 1000)) } : {}),
      ...(change.gpus !== undefined ? { gpus: String(change.gpus) } : {})
    });
    saveButton.current?.focus();
  };

  const shown = saved ?? check;
  const active = existing?.instances.find(i => i.state === 'active');
  const title = existing
    ? existing.mine
      ? `Change booking ${existing.id}`
      : `Booking ${existing.id} of ${existing.owner}`
    : `Book GPUs of ${fields.pool}`;
  const id = (name: string) => `jp-GpuLease-${name}-${existing?.id ?? 'new'}`;
  return (
    <div className="jp-GpuLease-overlay" onMouseDown={e => e.target === e.currentTarget && onClose()}>
      <div
        ref={dialog}
        role="dialog"
        aria-modal="true"
        aria-labelledby={titleId}
        className="jp-GpuLease-dialog"
        onKeyDown={e => {
          if (e.key === 'Escape') {
            e.stopPropagation();
            onClose();
          }
        }}
      >
        <h3 id={titleId} className="jp-GpuLease-heading">
          {title}
        </h3>
        {existing && (
          <p className="jp-GpuLease-hint">
            booked by {existing.created_by}
            {existing.repeat === 'weekly' ? ` · weekly, ${existing.occurrences} weeks: a change applies to all` : ''}
            {existing.node ? ` · on ${existing.node}` : ''}
          </p>
        )}
        <form
          className="jp-GpuLease-form"
          onSubmit={e => {
            e.preventDefault();
            if (editable) {
              void save();
            }
          }}
        >
          <fieldset disabled={!editable || busy !== null}>
            <label htmlFor={id('pool')}>Pool</label>
            <select
              id={id('pool')}
              className="jp-mod-styled"
              value={fields.pool}
              onChange={e => set({ pool: e.target.value })}
            >
              {(pools.includes(fields.pool) ? pools : [fields.pool, ...pools]).map(p => (
                <option key={p} value={p}>
                  {p}
                </option>
              ))}
            </select>
            <label htmlFor={id('gpus')}>GPUs</label>
            <input
              id={id('gpus')}
              type="number"
              min={1}
              step={1}
              value={fields.gpus}
              onChange={e => set({ gpus: e.target.value })}
            />
            <label htmlFor={id('start')}>Start</label>
            <input
              id={id('start')}
              type="datetime-local"
              value={fields.start}
              onChange={e => set({ start: e.target.value })}
            />
            <label htmlFor={id('end')}>End</label>
            <input
              id={id('end')}
              type="datetime-local"
              value={fields.end}
              onChange={e => set({ end: e.target.value })}
            />
            <label htmlFor={id('owner')}>Owner</label>
            <input
              id={id('owner')}
              type="text"
              placeholder={`you (${model.user ?? 'me'}), or team:NAME`}
              value={fields.owner}
              onChange={e => set({ owner: e.target.value })}
            />
            <label htmlFor={id('note')}>Note</label>
            <input id={id('note')} type="text" value={fields.note} onChange={e => set({ note: e.target.value })} />
            <label htmlFor={id('repeat')}>Repeat</label>
            <span className="jp-GpuLease-inline">
              <select
                id={id('repeat')}
                className="jp-mod-styled"
                value={fields.repeat}
                onChange={e => set({ repeat: e.target.value === 'weekly' ? 'weekly' : 'none' })}
              >
                <option value="none">does not repeat</option>
                <option value="weekly">weekly</option>
              </select>
              {fields.repeat === 'weekly' && (
                <label>
                  for{' '}
                  <input
                    aria-label="Weeks"
                    type="number"
                    min={1}
                    max={52}
                    value={fields.occurrences}
                    onChange={e => set({ occurrences: e.target.value })}
                  />{' '}
                  weeks
                </label>
              )}
            </span>
            <span />
            <label className="jp-GpuLease-inline">
              <input
                type="checkbox"
                checked={fields.colocate}
                onChange={e => set({ colocate: e.target.checked })}
              />{' '}
              All on one node
            </label>
          </fieldset>
          <CheckView check={shown} pool={fields.pool} onApply={editable ? apply : null} />
          <div className="jp-GpuLease-dialogButtons">
            {existing?.mine && active && (
              <button
                type="button"
                className="jp-mod-styled jp-mod-warn"
                disabled={busy !== null}
                onClick={() => void act('end')}
              >
                {busy === 'end' ? 'Ending…' : 'End now'}
              </button>
            )}
            {existing?.mine && (
              <button
                type="button"
                className="jp-mod-styled jp-mod-warn"
                disabled={busy !== null}
                onClick={() => void act('cancel')}
              >
                {busy === 'cancel' ? 'Cancelling…' : 'Cancel booking'}
              </button>
            )}
            <span className="jp-GpuLease-spacer" />
            <button type="button" className="jp-mod-styled jp-mod-reject" onClick={() => onClose()}>
              Close
            </button>
            {editable && (
              <button ref={saveButton} type="submit" className="jp-mod-styled jp-mod-accept" disabled={busy !== null}>
                {busy === 'save' ? 'Saving…' : existing ? 'Save changes' : 'Book'}
              </button>
            )}
          </div>
        </form>
      </div>
    </div>
  );
}

/** Whether the booking fits, or the clash: who is in the way and what would fit instead. */
function CheckView(props: {
  check: Check;
  pool: string;
  onApply: ((change: { start?: number; end?: number; gpus?: number }) => void) | null;
}): JSX.Element | null {
  const { check, pool, onApply } = props;
  switch (check.state) {
    case 'idle':
      return null;
    case 'checking':
      return <div className="jp-GpuLease-check" role="status" aria-label="booking check">Checking…</div>;
    case 'fits':
      return (
        <div className="jp-GpuLease-check jp-GpuLease-fits" role="status" aria-label="booking check">
          Fits: no clash with other bookings.
        </div>
      );
    case 'invalid':
    case 'error':
      return (
        <div className="jp-GpuLease-error" role="alert">
          {check.message}
        </div>
      );
  }
  const clash = check.clash;
  return (
    <div className="jp-GpuLease-error jp-GpuLease-clash" role="alert" aria-label="clash">
      <strong title={check.serverMessage}>{check.message}</strong>
      {clash && (
        <>
          <p className="jp-GpuLease-hint jp-GpuLease-zone">
            Times in {ZONE} ({HOUR12 ? '12-hour' : '24-hour'}), as on the calendar.
          </p>
          <p>
            At most {gpuCount(clash.max_gpus)} of the {clash.capacity} in {pool} can be booked then
            {clash.reserved ? ` (${clash.reserved} already booked)` : ''}.
          </p>
          {clash.clashes.length > 0 && (
            <ul aria-label="clashing bookings" className="jp-GpuLease-clashes">
              {clash.clashes.map(c => (
                <li key={`${c.id}-${c.start}`}>
                  {c.owner} · {gpuCount(c.gpus)} · {formatWindow(c.start, c.end)} <code>{c.id}</code>
                </li>
              ))}
            </ul>
          )}
          {clash.suggestions.length > 0 && (
            <div className="jp-GpuLease-suggestions" role="group" aria-label="windows that fit">
              Nearest windows that fit:{' '}
              {clash.suggestions.map(s => (
                <button
                  key={`${s.start}-${s.end}`}
                  type="button"
                  className="jp-mod-styled"
                  disabled={!onApply}
                  aria-label={`Use ${formatWindow(s.start, s.end)}`}
                  onClick={() => onApply?.({ start: s.start, end: s.end })}
                >
                  {formatWindow(s.start, s.end)}
                </button>
              ))}
            </div>
          )}
          {clash.max_gpus > 0 && onApply && (
            <button type="button" className="jp-mod-styled" onClick={() => onApply({ gpus: clash.max_gpus })}>
              Book {gpuCount(clash.max_gpus)} instead
            </button>
          )}
        </>
      )}
    </div>
  );
}
