"""The batch layer: nightly rebuilds of every view from the master dataset."""
