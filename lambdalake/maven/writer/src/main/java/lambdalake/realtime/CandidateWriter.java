package lambdalake.realtime;

import com.datastax.oss.driver.api.core.ConsistencyLevel;
import com.datastax.oss.driver.api.core.CqlSession;
import com.datastax.oss.driver.api.core.DefaultConsistencyLevel;
import com.datastax.oss.driver.api.core.cql.BatchStatement;
import com.datastax.oss.driver.api.core.cql.BatchType;
import com.datastax.oss.driver.api.core.cql.BoundStatement;
import com.datastax.oss.driver.api.core.cql.ColumnDefinitions;
import com.datastax.oss.driver.api.core.cql.PreparedStatement;
import com.datastax.oss.driver.api.core.servererrors.InvalidQueryException;
import com.datastax.oss.driver.api.core.servererrors.SyntaxError;
import com.datastax.oss.driver.api.core.servererrors.UnauthorizedException;
import com.datastax.oss.driver.api.core.type.DataType;
import com.datastax.oss.driver.api.core.type.DataTypes;
import java.math.BigDecimal;
import java.nio.ByteBuffer;
import java.time.Instant;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ConcurrentLinkedQueue;
import java.util.concurrent.Semaphore;
import java.util.concurrent.TimeUnit;
import org.apache.spark.sql.ForeachWriter;
import org.apache.spark.sql.Row;

/**
 * Writes the {@code latest} views' ranked candidates to Cassandra: per candidate the same two
 * statements as the micro-batch path's writer (lambdalake/cassandra/writer.py), an INSERT of the
 * candidate and a DELETE of the key's lower-ranked ones, in one unlogged batch of one partition, at
 * the settings' consistency.
 *
 * <p>A row is a record: its first column holds a writer schema id the query could not decode (null
 * otherwise), and each later column one view's candidate (a struct of the view table's columns in
 * its order), null where the view does not keep the record. A row with an unknown id stops the task
 * with {@link UnknownWriterSchema}, and the query is started again knowing it, from its checkpoint.
 *
 * <p>Delivery: at least once, idempotent. Writes go out as each row arrives (a bounded number in
 * flight); {@link #close} waits for all of them, so the epoch's offsets are committed only after
 * its candidates are acknowledged. A write that fails for a reason a retry can mend (a timeout, a
 * replica down) is sent again with backoff for up to {@code giveUpAfterMs}, then fails the task.
 */
public final class CandidateWriter extends ForeachWriter<Row> {
  private static final long serialVersionUID = 1L;
  /** Writes in flight per task: bounds memory, not latency (each row is sent on arrival). */
  private static final int IN_FLIGHT = 128;

  private final Cluster cluster;
  private final String[] insertCqls;
  private final String[] deleteCqls;
  private final int[][] deleteAts;
  private final String consistency;
  private final long giveUpAfterMs;

  private transient CqlSession session;
  private transient PreparedStatement[] inserts;
  private transient PreparedStatement[] deletes;
  private transient Semaphore slots;
  private transient ConcurrentLinkedQueue<Failed> failed;
  private transient ConsistencyLevel level;

  /**
   * @param cluster where to connect (contact points, port, credentials, protocol version).
   * @param insertCqls per view, its table's INSERT, one marker a column, in the candidates' order.
   * @param deleteCqls per view, the DELETE of a key's lower candidates (the partition key, the rank).
   * @param deleteAts per view, where the DELETE's values are among a candidate's columns.
   * @param consistency a CQL consistency level's name (the settings' {@code consistency}).
   * @param giveUpAfterMs how long a retryable failure is retried before the task fails.
   */
  public CandidateWriter(
      Cluster cluster,
      List<String> insertCqls,
      List<String> deleteCqls,
      List<List<Integer>> deleteAts,
      String consistency,
      long giveUpAfterMs) {
    this.cluster = cluster;
    this.insertCqls = insertCqls.toArray(new String[0]);
    this.deleteCqls = deleteCqls.toArray(new String[0]);
    this.deleteAts = new int[deleteAts.size()][];
    for (int v = 0; v < this.deleteAts.length; v++) {
      this.deleteAts[v] = deleteAts.get(v).stream().mapToInt(Integer::intValue).toArray();
    }
    this.consistency = consistency;
    this.giveUpAfterMs = giveUpAfterMs;
  }

  @Override
  public boolean open(long partitionId, long epochId) {
    session = Sessions.get(cluster);
    inserts = new PreparedStatement[insertCqls.length];
    deletes = new PreparedStatement[deleteCqls.length];
    for (int v = 0; v < inserts.length; v++) {
      inserts[v] = Sessions.prepare(session, insertCqls[v]);
      deletes[v] = Sessions.prepare(session, deleteCqls[v]);
    }
    level = DefaultConsistencyLevel.valueOf(consistency);
    slots = new Semaphore(IN_FLIGHT);
    failed = new ConcurrentLinkedQueue<>();
    return true;
  }

  @Override
  public void process(Row row) {
    if (!row.isNullAt(0)) {
      throw new UnknownWriterSchema(row.getInt(0));
    }
    retryFailed();
    long deadline = System.currentTimeMillis() + giveUpAfterMs;
    for (int v = 0; v < inserts.length; v++) {
      if (!row.isNullAt(1 + v)) {
        send(statement(v, row.getStruct(1 + v)), deadline);
      }
    }
  }

  @Override
  public void close(Throwable error) {
    if (session == null || error != null) {
      return;
    }
    slots.acquireUninterruptibly(IN_FLIGHT);
    slots.release(IN_FLIGHT);
    while (!failed.isEmpty()) {
      retryFailed();
    }
  }

  private BatchStatement statement(int view, Row candidate) {
    ColumnDefinitions columns = inserts[view].getVariableDefinitions();
    Object[] values = new Object[columns.size()];
    for (int i = 0; i < values.length; i++) {
      values[i] = value(candidate, i, columns.get(i).getType());
    }
    int[] at = deleteAts[view];
    Object[] lower = new Object[at.length];
    for (int i = 0; i < lower.length; i++) {
      lower[i] = values[at[i]];
    }
    BoundStatement row = inserts[view].bind(values);
    BoundStatement below = deletes[view].bind(lower);
    return BatchStatement.newInstance(BatchType.UNLOGGED, row, below).setConsistencyLevel(level);
  }

  private void send(BatchStatement batch, long deadline) {
    slots.acquireUninterruptibly();
    session
        .executeAsync(batch)
        .whenComplete(
        (result, error) -> {
          if (error != null) {
            failed.add(new Failed(batch, error, deadline));
          }
          slots.release();
        });
  }

  /** Sends again each write that failed, after a pause; fails the task on a permanent error. */
  private void retryFailed() {
    long delay = 500;
    Failed first;
    while ((first = failed.poll()) != null) {
      if (permanent(first.error)) {
        throw new IllegalStateException(
            "Cassandra refused a candidate write: " + first.error.getMessage(), first.error);
      }
      if (System.currentTimeMillis() > first.deadline) {
        throw new IllegalStateException(
            "a candidate write still failed after " + giveUpAfterMs / 1000 + "s: " + first.error,
            first.error);
      }
      try {
        TimeUnit.MILLISECONDS.sleep(delay);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
        throw new IllegalStateException("interrupted while retrying a candidate write", e);
      }
      delay = Math.min(delay * 2, 10_000);
      List<Failed> again = new ArrayList<>();
      again.add(first);
      Failed next;
      while ((next = failed.poll()) != null) {
        again.add(next);
      }
      for (Failed f : again) {
        send(f.batch, f.deadline);
      }
      slots.acquireUninterruptibly(IN_FLIGHT);
      slots.release(IN_FLIGHT);
    }
  }

  private static boolean permanent(Throwable error) {
    return error instanceof InvalidQueryException
        || error instanceof SyntaxError
        || error instanceof UnauthorizedException
        || error instanceof IllegalArgumentException
        || error instanceof ClassCastException;
  }

  /**
   * A row's value as the column's CQL type takes it. The query casts each column to the Spark type
   * of its CQL type first (lambdalake/spark/realtime.py), so only these pairs occur.
   */
  static Object value(Row row, int i, DataType type) {
    if (row.isNullAt(i)) {
      return null;
    }
    Object v = row.get(i);
    if (type.equals(DataTypes.BLOB)) {
      return ByteBuffer.wrap((byte[]) v);
    }
    if (type.equals(DataTypes.VARINT)) {
      return ((BigDecimal) v).toBigIntegerExact();
    }
    if (type.equals(DataTypes.TIMESTAMP)) {
      if (v instanceof java.sql.Timestamp t) {
        return t.toInstant();
      }
      return (Instant) v;
    }
    return v;
  }

  private record Failed(BatchStatement batch, Throwable error, long deadline) {}
}
