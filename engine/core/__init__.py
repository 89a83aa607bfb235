"""The engine core: the step (schedule -> run -> update -> report), the scheduler, the block manager, sequences, and the records that cross to the front-end."""
