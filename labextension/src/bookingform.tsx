/**
 * The booking form (a modal dialog): a new booking, or one to change, cancel or end (mine), or to
 * see (anyone's). While it is filled in, it asks the lease server (a dry run) whether the booking
 * fits, and shows the answer (clash.tsx). Also the "Cancel booking" confirmation, which My bookings
 * on the Board tab asks too.
 */
import React, { useEffect, useRef, useState } from 'react';

import { IBooking } from './api';
import { Check, DialogTarget, IFields, changesOf, clashOf, toBooking } from './booking';
import { CheckView } from './clash';
import { formatWindow, gpuCount, toLocalInput } from './clock';
import { confirmAction } from './confirm';
import { GpuLeaseModel } from './model';

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

export function BookingDialog(props: {
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
  }, [fields, editable, existing, model]);

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
