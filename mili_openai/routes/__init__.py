"""The endpoints: each validates its request (protocol/), submits it to the engine and answers through
the server's plumbing (server/)."""
