"""The profiler: step records into trace files (writer process, SQLite store, codec), reading
them back, analyses, Chrome export, and expert load imported from SGLang and vLLM."""
