"""Transports: the HTTP API (Unix socket and TCP) and MQTT, each translating errors at its edge."""
