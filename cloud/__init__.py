"""The cloud worker: our long-context engine (model/ loads and runs models, engine/ schedules them)."""
