"""GROUP-PPO for verl: token-group advantages with a critic consulted at group boundaries."""

__version__ = "0.1.0"
