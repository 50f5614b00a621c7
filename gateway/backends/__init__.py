"""What answers the OpenAI routes: the engine (in this process or a child), a worker's routes, the fleet."""
