// clock.ts: times on the locale's 12- or 24-hour clock, in the browser's zone (TZ=UTC here, set by
// vitest.config.mts, unless a test picks another), and the datetime-local inputs' values.
import { afterEach, describe, expect, test } from 'vitest';

import { clock, formatTime, formatWindow, fromLocalInput, gpuCount, localeHour12, toLocalInput } from '../src/clock';

const at = (iso: string) => Date.parse(iso) / 1000;

describe('localeHour12', () => {
  test('reads the clock of a locale', () => {
    expect(localeHour12('en-US')).toBe(true);
    expect(localeHour12('de-DE')).toBe(false);
    expect(localeHour12('en-GB')).toBe(false);
  });
});

describe('clock', () => {
  test('24-hour: two-digit hours', () => {
    expect(clock(new Date(2026, 10, 24, 0, 5), false)).toBe('00:05');
    expect(clock(new Date(2026, 10, 24, 13, 30), false)).toBe('13:30');
  });

  test('12-hour: midnight is 12 AM, noon is 12 PM', () => {
    expect(clock(new Date(2026, 10, 24, 0, 5), true)).toBe('12:05 AM');
    expect(clock(new Date(2026, 10, 24, 9, 0), true)).toBe('9:00 AM');
    expect(clock(new Date(2026, 10, 24, 12, 0), true)).toBe('12:00 PM');
    expect(clock(new Date(2026, 10, 24, 23, 59), true)).toBe('11:59 PM');
  });
});

describe('formatTime and formatWindow', () => {
  const savedTz = process.env.TZ;
  afterEach(() => {
    process.env.TZ = savedTz;
  });

  test('a time: weekday, day, month and clock', () => {
    expect(formatTime(at('2026-11-24T10:00:00Z'), false)).toBe('Tue 24 Nov 10:00');
    expect(formatTime(at('2026-11-24T15:45:00Z'), true)).toBe('Tue 24 Nov 3:45 PM');
  });

  test('a window within a day writes the date once', () => {
    expect(formatWindow(at('2026-11-24T10:00:00Z'), at('2026-11-24T12:00:00Z'), false)).toBe('Tue 24 Nov 10:00–12:00');
    expect(formatWindow(at('2026-11-24T10:00:00Z'), at('2026-11-24T12:00:00Z'), true)).toBe(
      'Tue 24 Nov 10:00 AM–12:00 PM'
    );
  });

  test('a window over midnight writes both dates', () => {
    expect(formatWindow(at('2026-11-24T22:00:00Z'), at('2026-11-25T02:00:00Z'), false)).toBe(
      'Tue 24 Nov 22:00–Wed 25 Nov 02:00'
    );
  });

  test("times are the browser's zone's: a UTC morning is the evening before in New York", () => {
    process.env.TZ = 'America/New_York';
    expect(formatWindow(at('2026-11-24T03:00:00Z'), at('2026-11-24T05:00:00Z'), false)).toBe(
      'Mon 23 Nov 22:00–Tue 24 Nov 00:00'
    );
  });
});

describe('datetime-local values', () => {
  test('a Date as an input value, in local time, to the minute', () => {
    expect(toLocalInput(new Date(2026, 0, 5, 7, 3, 59))).toBe('2026-01-05T07:03');
  });

  test('an input value as epoch seconds (local time)', () => {
    expect(fromLocalInput('2026-11-24T10:00')).toBe(at('2026-11-24T10:00:00Z'));
    expect(fromLocalInput('2026-11-24T10:00:30')).toBe(at('2026-11-24T10:00:30Z'));
  });

  test('a value round-trips', () => {
    const d = new Date(2026, 6, 1, 18, 30);
    expect(fromLocalInput(toLocalInput(d))).toBe(d.getTime() / 1000);
  });

  test('anything but a date and a time is NaN', () => {
    for (const value of ['', '2026-11-24', '10:00', '2026-11-24 10:00', '2026-11-24T10:00Z']) {
      expect(fromLocalInput(value)).toBeNaN();
    }
  });
});

test('gpuCount: one GPU, else GPUs', () => {
  expect(gpuCount(1)).toBe('1 GPU');
  expect(gpuCount(0)).toBe('0 GPUs');
  expect(gpuCount(4)).toBe('4 GPUs');
});
