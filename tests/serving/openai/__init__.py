"""The OpenAI front end, mirroring `tandem/serving/openai/`."""
