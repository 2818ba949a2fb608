"""The controller: turns configuration into supervisord programs and owns every decision
about them (start order, health, restarts, back-off, shutdown). supervisord does the
fork/exec/reap; this package decides."""
