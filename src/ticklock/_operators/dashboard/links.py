"""The dashboard's URLs for one request, under wherever the app is mounted."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

from starlette.requests import Request


class Links:
    """The dashboard's URLs for one request: paths under wherever the app is mounted.

    Job ids are percent-encoded whole (``/`` included), so ids with slashes, spaces or
    non-ASCII characters round-trip through the ``{job_id:path}`` routes.
    """

    def __init__(self, request: Request) -> None:
        self._request = request

    def _path(self, name: str, query: dict[str, Any] | None = None, **params: str) -> str:
        path = self._request.url_for(name, **params).path
        query = {k: v for k, v in (query or {}).items() if v is not None}
        return f"{path}?{urlencode(query)}" if query else path

    def index(self, **query: Any) -> str:
        """The jobs page; ``query`` becomes its query string."""
        return self._path("index", query)

    def job(self, job_id: str, **query: Any) -> str:
        """A job's page."""
        return self._path("job", query, job_id=quote(job_id, safe=""))

    def action(self, job_id: str, action: str) -> str:
        """Where a job's Pause, Resume or Trigger form posts."""
        return self._path("action", job_id=quote(job_id, safe=""), action=action)

    def runs(self, job_id: str, **query: Any) -> str:
        """A job's runs as JSON."""
        return self._path("api_runs", query, job_id=quote(job_id, safe=""))

    def slots(self, job_id: str, **query: Any) -> str:
        """A job's slots as JSON."""
        return self._path("api_slots", query, job_id=quote(job_id, safe=""))

    def schedules(self, **query: Any) -> str:
        """The stored schedules' page; ``query`` (tenant, task, after) its query string."""
        return self._path("schedules", query)

    def api_schedules(self, **query: Any) -> str:
        """The stored schedules as JSON."""
        return self._path("api_schedules", query)

    def style(self) -> str:
        """The stylesheet."""
        return self._path("style")

    def api_jobs(self) -> str:
        """Every job as JSON."""
        return self._path("api_jobs")

    def api_replicas(self) -> str:
        """The live replicas as JSON."""
        return self._path("api_replicas")

    def health(self) -> str:
        """The health probe."""
        return self._path("health")
