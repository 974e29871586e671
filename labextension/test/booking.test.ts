// booking.ts: the booking form's fields as a booking (or what is wrong with them), the changes a
// PATCH sends, and what the form says of the lease server's answer.
import { describe, expect, test } from 'vitest';

import { GpuLeaseError, IBooking, IBookingRequest, IClash } from '../src/api';
import { IFields, changesOf, clashOf, toBooking } from '../src/booking';
import { formatWindow } from '../src/clock';

const at = (iso: string) => Date.parse(iso) / 1000;

const fields = (changes: Partial<IFields> = {}): IFields => ({
  pool: 'A100',
  gpus: '2',
  start: '2026-11-24T10:00',
  end: '2026-11-24T12:00',
  owner: '',
  note: '',
  repeat: 'none',
  occurrences: '4',
  colocate: false,
  ...changes
});

const existing: IBooking = {
  id: 'r-1',
  owner: 'alice',
  pool: 'A100',
  gpus: 2,
  start: at('2026-11-24T10:00:00Z'),
  end: at('2026-11-24T12:00:00Z'),
  repeat: 'none',
  occurrences: 1,
  colocate: false,
  node: '',
  note: 'training',
  created_by: 'alice',
  created_at: 0,
  state: 'active',
  mine: true,
  instances: []
};

describe('toBooking', () => {
  test('the fields as a booking: times as epoch seconds, owner and note trimmed', () => {
    expect(toBooking(fields({ owner: ' team:vision ', note: ' sweep ' }))).toEqual({
      pool: 'A100',
      gpus: 2,
      start: at('2026-11-24T10:00:00Z'),
      end: at('2026-11-24T12:00:00Z'),
      repeat: 'none',
      colocate: false,
      owner: 'team:vision',
      note: 'sweep'
    });
  });

  test('an empty owner and note are left out (the lease server picks the owner)', () => {
    const booking = toBooking(fields({ owner: '  ', note: '' })) as IBookingRequest;
    expect(booking).not.toHaveProperty('owner');
    expect(booking).not.toHaveProperty('note');
    expect(booking).not.toHaveProperty('occurrences');
  });

  test('GPUs must be a whole number, 1 or more', () => {
    for (const gpus of ['0', '-1', '1.5', 'two', '']) {
      expect(toBooking(fields({ gpus }))).toBe('GPUs must be a whole number, 1 or more');
    }
  });

  test('a start and an end are needed, the end after the start', () => {
    expect(toBooking(fields({ start: '' }))).toBe('give a start and an end (date and time)');
    expect(toBooking(fields({ end: '2026-11-24' }))).toBe('give a start and an end (date and time)');
    expect(toBooking(fields({ end: '2026-11-24T10:00' }))).toBe('the end must be after the start');
    expect(toBooking(fields({ end: '2026-11-24T09:00' }))).toBe('the end must be after the start');
  });

  test('weekly: 1 to 52 weeks, sent as occurrences', () => {
    expect(toBooking(fields({ repeat: 'weekly', occurrences: '4' }))).toMatchObject({
      repeat: 'weekly',
      occurrences: 4
    });
    for (const occurrences of ['0', '53', '2.5', '']) {
      expect(toBooking(fields({ repeat: 'weekly', occurrences }))).toBe('weeks must be a whole number from 1 to 52');
    }
    // the weeks field is ignored unless the booking repeats
    expect(toBooking(fields({ repeat: 'none', occurrences: '99' }))).not.toBeTypeOf('string');
  });
});

describe('changesOf', () => {
  const same = (): IBookingRequest => ({
    pool: 'A100',
    gpus: 2,
    start: existing.start,
    end: existing.end,
    repeat: 'none',
    colocate: false,
    note: 'training'
  });

  test('nothing changed: nothing to send', () => {
    expect(changesOf(existing, same())).toEqual({});
  });

  test('a time with seconds that the form shows to the minute is not a change', () => {
    const made = { ...existing, start: existing.start + 17, end: existing.end + 42 }; // by the CLI
    expect(changesOf(made, { ...same(), note: 'fine-tuning' })).toEqual({ note: 'fine-tuning' });
    expect(changesOf(made, { ...same(), end: existing.end + 60 })).toEqual({ end: existing.end + 60 });
  });

  test('only the fields that differ', () => {
    expect(changesOf(existing, { ...same(), gpus: 3, end: existing.end + 3600 })).toEqual({
      gpus: 3,
      end: existing.end + 3600
    });
  });

  test('a note emptied in the form is sent as an empty note', () => {
    const { note: _note, ...withoutNote } = same();
    expect(changesOf(existing, withoutNote)).toEqual({ note: '' });
  });

  test('an owner left empty keeps the owner', () => {
    expect(changesOf(existing, same())).not.toHaveProperty('owner');
    expect(changesOf(existing, { ...same(), owner: 'team:vision' })).toEqual({ owner: 'team:vision' });
  });
});

describe('clashOf', () => {
  const clash: IClash = {
    clashes: [{ id: 'r-2', owner: 'bob', gpus: 3, start: existing.start, end: existing.end }],
    capacity: 4,
    reserved: 3,
    max_gpus: 1,
    suggestions: [{ start: existing.end, end: existing.end + 7200 }]
  };
  const booking: IBookingRequest = { pool: 'A100', gpus: 2, start: existing.start, end: existing.end };

  test("a 409 with a clash: the headline in the browser's times, the server's message kept", () => {
    const error = new GpuLeaseError(409, 'reservation_clash', 'over-booked at 10:00 UTC', clash);
    expect(clashOf(error, booking)).toEqual({
      state: 'clash',
      message: `2 GPUs of A100, ${formatWindow(booking.start, booking.end)}, would over-book it (4 can be booked)`,
      clash,
      serverMessage: 'over-booked at 10:00 UTC'
    });
  });

  test('a weekly booking says how many times', () => {
    const error = new GpuLeaseError(409, 'reservation_clash', 'over-booked', clash);
    const check = clashOf(error, { ...booking, repeat: 'weekly', occurrences: 3 });
    expect(check.state === 'clash' && check.message).toContain(' (weekly, 3 times), would over-book it');
  });

  test("a 409 without a clash's details: the server's message", () => {
    const error = new GpuLeaseError(409, 'conflict', 'the booking changed meanwhile', { clashes: 'no' });
    expect(clashOf(error, booking)).toEqual({ state: 'clash', message: 'the booking changed meanwhile', clash: null });
  });

  test('any other error is an error, in words', () => {
    expect(clashOf(new GpuLeaseError(403, 'forbidden', 'not your booking'), booking)).toEqual({
      state: 'error',
      message: 'not your booking'
    });
    expect(clashOf(new Error('boom'), null)).toEqual({ state: 'error', message: 'boom' });
    expect(clashOf('offline', null)).toEqual({ state: 'error', message: 'offline' });
  });
});
