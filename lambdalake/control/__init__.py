"""The control plane: the platform's operations (deploy, view build, replay and its batch, restore, the
batch scheduler's runner) as plain typed functions that the CLI, the HTTP API or a user's own
orchestrator call. It sits above the layers and calls them; nothing below imports it."""
