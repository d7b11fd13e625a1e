"""The backends behind the runtime's seam: memory and PostgreSQL."""
