"""The record store, the layer everything builds on; it imports nothing else of spectie.

- `store`: every record built, validated (`record.schema.json`), written and read, and reused where the same
  measurement is recorded; `record_types` and `record_fields`: what each kind of record holds, as readers get it;
- `fingerprint`: where a measurement ran (host, device, libraries) and the measurement key;
- `environments`: the environments a record stands for; `chapters`: the chapters records belong to, and the content
  hash of a run; `completions`: what a recorded completion says;
- `paths` and `errors`: the project's folders, and the usage error (exit code 2).
"""
