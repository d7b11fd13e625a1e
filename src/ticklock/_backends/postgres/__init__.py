"""PostgreSQL mode: the coordinator (a tick is one transaction holding the job's advisory
lock), the connections (asyncpg's pool, ``ctx.conn``), ticklock's tables and the retention job.

Loaded only when a scheduler is given a DSN or a pool: asyncpg stays out of ``import ticklock``.
"""
