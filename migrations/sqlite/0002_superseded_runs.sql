-- A run whose output was taken by another run (a replacement, a fresh start by a Python collector,
-- or an output directory deleted and recreated) stays in history, marked with the run that took it
-- over; its output_path gains a `#superseded-by-<run id>` suffix so the live run owns the path.
ALTER TABLE runs ADD COLUMN superseded_by TEXT;
