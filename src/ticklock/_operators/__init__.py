"""What operators see and do: fleet operations, the ledger, health, dashboard, CLI."""
