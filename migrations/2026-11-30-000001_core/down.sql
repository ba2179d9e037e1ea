DROP TABLE IF EXISTS command_receipts, thread_events, run_steps, runs, messages, threads, api_keys, principals;
