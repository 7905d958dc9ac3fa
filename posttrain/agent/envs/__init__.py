"""Example environments: `gsm8k_python:GSM8KPython` (GSM8K with the python tool), `chain_sum:ChainSum`
(reasoning-gym chain_sum with the calculator) and `guess_number:GuessNumber` (a `step` text game). Name them as
`posttrain.agent.envs.gsm8k_python:GSM8KPython` etc."""
