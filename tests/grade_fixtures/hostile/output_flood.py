"""Attack (mine): print without end, to fill the grader's memory or disk with outputs. Must: the
guard stops the sandbox once it printed more than the limit; outputs are never stored."""
# where: start
while True:
    print("LABKIT-HOSTILE " * 4096)
