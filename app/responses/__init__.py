"""The Responses API's objects (objects.py: output items, usage, a stored turn as a response) and its streamed
events (events.py); the routes are app/responses_api.py."""
