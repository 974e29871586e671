-- fold.lua: add the ledger lines written since the last fold to the hourly rollups
-- (fold_rollups, _lib_end.lua), so that a reader of the rollups (the usage page, /metrics) sees
-- every lease that has ended, not only those up to the last sweep.
-- KEYS: ledger rollup rollup_idx rollup_at
-- ARGV[6] = most lines read in this call
-- returns {OK, lines read} (all of ARGV[6]: call again)
return {OK, fold_rollups(tonumber(ARGV[6]))}
