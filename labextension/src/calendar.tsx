/**
 * The booking calendar: everyone's bookings of one pool in a week or day view (FullCalendar), live
 * from the event stream. Drag over free time to book it; click a booking to change or cancel it
 * (yours) or to see it (anyone's). "New booking…" opens the same form without a mouse.
 *
 * The form is bookingform.tsx (its logic booking.ts, its clash view clash.tsx); times are written
 * as clock.ts writes them: in the browser's time zone, on the locale's clock. They are sent as
 * epoch seconds (the lease server stores UTC).
 */
import { Calendar, EventInput } from '@fullcalendar/core';
import interactionPlugin from '@fullcalendar/interaction';
import timeGridPlugin from '@fullcalendar/timegrid';
import React, { useEffect, useRef, useState } from 'react';

import { IBooking, IInstance } from './api';
import { DialogTarget } from './booking';
import { BookingDialog } from './bookingform';
import { HOUR12, ZONE, formatWindow, gpuCount, pad } from './clock';
import { GpuLeaseModel, describe } from './model';

/** Where the calendar was (pool, view, day), kept while the Board tab is shown. */
export interface ICalendarPlace {
  pool: string;
  view: string;
  date: Date | null;
  /** The newest "New booking…" request (a command's seq) the form was opened for. */
  newBookingSeen: number;
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

export function BookingCalendar(props: {
  model: GpuLeaseModel;
  place: ICalendarPlace;
  /** A "New booking…" command's seq: the form opens once for each new one. */
  newBooking?: number;
}): JSX.Element {
  const { model, place, newBooking = 0 } = props;
  const pools = Object.keys(model.cluster?.pools ?? {}).sort();
  const [pool, setPool] = useState(() => {
    if (place.pool && pools.includes(place.pool)) {
      return place.pool;
    }
    const preferred = model.cluster?.default_pool;
    return preferred && pools.includes(preferred) ? preferred : (pools[0] ?? '');
  });
  const [dialog, setDialog] = useState<DialogTarget | null>(null);
  const [loadError, setLoadError] = useState<string | null>(null);
  const [announce, setAnnounce] = useState('');
  const host = useRef<HTMLDivElement>(null);
  const calendar = useRef<Calendar | null>(null);
  const poolRef = useRef(pool);
  // The pool shown, kept where the panel keeps the calendar's place and where the calendar's event
  // source reads it (written after render, not during it: render leaves its props alone).
  useEffect(() => {
    place.pool = pool;
    poolRef.current = pool;
  }, [place, pool]);

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
  }, [model, place]);

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
  }, [newBooking, place]);

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
            onChange={e => setPool(e.target.value)}
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
