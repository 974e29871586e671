// Vitest (npm test): the unit tests in test/, in Node (no browser), in a fixed time zone so that
// the times they check read the same on every machine.
import { defineConfig } from 'vitest/config';

process.env.TZ = 'UTC';

export default defineConfig({
  test: {
    include: ['test/**/*.test.{ts,tsx}'],
    environment: 'node'
  }
});
