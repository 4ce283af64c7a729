"""The OpenAI Batch API's storage and driving, apart from HTTP: input files checked line by line
(`input_file.py`), whose a file or batch is (`owners.py`: an API key's tenant, or the admin), files
on disk with their metadata in Redis (`storage.py`), batch records and per-line progress in Redis
(`records.py`), and the loop that queues a batch's lines as ordinary
`genq.generate` tasks and writes their answers (`driver.py`). docs/gateway.md, Batch API."""
