/**
 * Times as the page writes them: on the browser locale's clock (12- or 24-hour), in the browser's
 * time zone, and as the value of an <input type="datetime-local">. The lease server stores and
 * sends epoch seconds (UTC); these turn them into what people read and type, and back.
 */

const DAYS = ['Sun', 'Mon', 'Tue', 'Wed', 'Thu', 'Fri', 'Sat'];
const MONTHS = ['Jan', 'Feb', 'Mar', 'Apr', 'May', 'Jun', 'Jul', 'Aug', 'Sep', 'Oct', 'Nov', 'Dec'];
export const pad = (n: number): string => String(n).padStart(2, '0');

/** Whether a locale (the browser's when none is given) reads the clock 12-hour (en-US) or 24-hour (de-DE, en-GB). */
export function localeHour12(locale?: string): boolean {
  return new Intl.DateTimeFormat(locale, { hour: 'numeric' }).resolvedOptions().hour12 === true;
}

/**
 * The browser locale's clock: true where it reads 12-hour (en-US), false for 24-hour (de-DE, en-GB).
 * Every time on the page (grid, lists, clash) follows it, as the form's native date-time inputs do.
 */
export const HOUR12 = localeHour12();

/** The browser's time zone ("Europe/Berlin"): the calendar and the form show and take times in it. */
export const ZONE = Intl.DateTimeFormat().resolvedOptions().timeZone;

/** "10:00", or "10:00 AM" where the clock is 12-hour. */
export function clock(d: Date, hour12: boolean = HOUR12): string {
  if (!hour12) {
    return `${pad(d.getHours())}:${pad(d.getMinutes())}`;
  }
  return `${((d.getHours() + 11) % 12) + 1}:${pad(d.getMinutes())} ${d.getHours() < 12 ? 'AM' : 'PM'}`;
}

/** "Tue 24 Nov 10:00" in the browser's time zone, on the locale's clock. */
export function formatTime(epoch: number, hour12: boolean = HOUR12): string {
  const d = new Date(epoch * 1000);
  return `${DAYS[d.getDay()]} ${d.getDate()} ${MONTHS[d.getMonth()]} ${clock(d, hour12)}`;
}

/** "Tue 24 Nov 10:00–12:00", or with both dates when the window spans midnight. */
export function formatWindow(start: number, end: number, hour12: boolean = HOUR12): string {
  const a = new Date(start * 1000);
  const b = new Date(end * 1000);
  const sameDay = a.toDateString() === b.toDateString();
  return `${formatTime(start, hour12)}–${sameDay ? clock(b, hour12) : formatTime(end, hour12)}`;
}

/** "1 GPU", "3 GPUs". */
export function gpuCount(n: number): string {
  return `${n} GPU${n === 1 ? '' : 's'}`;
}

/** A Date as the value of an <input type="datetime-local"> (local time, minutes). */
export function toLocalInput(date: Date): string {
  return (
    `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())}` +
    `T${pad(date.getHours())}:${pad(date.getMinutes())}`
  );
}

/** The value of a datetime-local input as epoch seconds (it is local time), or NaN. */
export function fromLocalInput(value: string): number {
  if (!/^\d{4}-\d\d-\d\dT\d\d:\d\d(:\d\d)?$/.test(value)) {
    return NaN;
  }
  return new Date(value).getTime() / 1000; // a date-time without an offset is local time
}
