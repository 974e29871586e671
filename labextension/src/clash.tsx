/**
 * The booking form's check, as the form shows it: checking, fits, what is wrong, or a clash (the
 * bookings in the way, how many GPUs would fit, and the nearest windows that fit, each one applied
 * with one click). Times in the browser's zone, on the locale's clock, as on the calendar.
 */
import React from 'react';

import { Check } from './booking';
import { HOUR12, ZONE, formatWindow, gpuCount } from './clock';

/** Whether the booking fits, or the clash: who is in the way and what would fit instead. */
export function CheckView(props: {
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
