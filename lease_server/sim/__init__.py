"""The policy simulator: replay a notebook workload under the ways teams share GPUs, and compare.

``workload`` loads traces and event-log exports and groups cells into notebook sessions;
``policies`` models the calendar and the session-held + idle-culler policies as event simulations;
``replay`` drives the lease server's own Lua scripts on a real Redis under a virtual clock;
``bookings`` deals users into teams and makes their bookings for ``lease+booking``;
``report`` turns results into the table, CSV files and figure of ``gpulease simulate``;
``fairness`` measures max-min fairness window by window (bench/sched_bench.py).
See docs/simulation.md.
"""
