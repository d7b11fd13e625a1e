"""The schedule: triggers, cron, zones, a job's declaration and its validation."""
